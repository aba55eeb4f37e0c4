"""Context and expert parallelism in the exports: torchtitan and Megatron-LM state cp (their own
context-parallel degree, data parallelism counted without it); DeepSpeed's config cannot and refuses;
Megatron-LM writes the zoo's mixture of experts and the expert layout (ep, expert tp 1, the
all-to-all dispatcher); torchtitan writes it as its own MoE (a Qwen3Model of Llama layers) with its
expert-parallel degree; DeepSpeed lists ep as a difference. The `export` tests parse the files with
torchtitan and megatron-core themselves, and build torchtitan's model on the meta device."""

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
    """torchtitan writes the zoo's mixture of experts as its own MoE with expert_parallel_degree, the
    zoo's capacity routing and Switch loss named as differences (torchtitan routes dropless and
    balances with a bias); DeepSpeed writes it with ep as a difference."""
    plan = moe_plan()
    export = export_plan(plan, "torchtitan", allow_approx=True)
    training, parallelism, _ = _literal_settings(export.text)
    assert parallelism["expert_parallel_degree"] == 2
    assert "Qwen3TransformerBlock.Config" in export.text and "make_moe_config" in export.text
    assert [d.split(" (")[0] for d in export.differences if "experts" in d or "load-balancing" in d] == [
        "the plan's experts take at most 20 tokens of a sequence each", "the plan's router adds the Switch "
        "load-balancing loss"]
    dropless = autoplan.suggest(MOE + ",dropless=true,router_aux_loss_coef=0", "1x4xcpu", global_batch=8, seq_len=32,
                                ep=2, pp=1, zero=3, top=1)[0]
    assert export_plan(dropless, "torchtitan").differences == ()  # stated exactly: no --allow-approx needed
    # Megatron-LM's script states dropless routing as dropless (no capacity factor), as the plan runs it.
    megatron = export_plan(dropless, "megatron", allow_approx=True).text
    assert "--moe-expert-capacity-factor" not in megatron and "--moe-token-dispatcher-type alltoall" in megatron
    export = export_plan(plan, "deepspeed", allow_approx=True)
    assert any(d.startswith("ep 2: DeepSpeed splits experts only inside its own deepspeed.moe") for d in
               export.differences)
    assert "(ep 2)" in export.text


@functools.cache
def moe_tp_plan():
    """tp 2 x ep 8 on 2 nodes of 8 H100s: the plan's ep group (8 dp replicas at one tp index) spans both
    nodes, Megatron's folded one (8 consecutive ranks) one."""
    return autoplan.suggest(MOE.replace("num_experts=4", "num_experts=8"), "2x8xH100-80GB", global_batch=64,
                            seq_len=32, tp=2, ep=8, pp=1, micro_batch_size=1, zero=0, top=1)[0]


def test_megatron_writes_the_expert_layout_and_the_experts(tmp_path):
    """Megatron-LM's flags (read back by bash, parsed with the recorded core_v0.16.1 flags): ep and
    expert tp 1, the all-to-all dispatcher, the experts and their router as the zoo builds them,
    capacity routing as a capacity factor; no difference on the expert groups: the plan folds them over
    tp x dp as Megatron does (plan.py [Note: expert layout])."""
    plan = moe_tp_plan()
    assert (plan.tp, plan.dp, plan.ep, plan.expert_tp) == (2, 8, 8, 1)
    export = export_plan(plan, "megatron", allow_approx=True)
    ns = parse_megatron(_sourced_args(export.text, tmp_path))
    assert (ns.expert_model_parallel_size, ns.expert_tensor_parallel_size) == (8, 1)
    assert (ns.num_experts, ns.moe_ffn_hidden_size, ns.moe_router_topk) == (8, 96, 2)
    assert ns.moe_token_dispatcher_type == "alltoall" and ns.moe_grouped_gemm
    assert not ns.moe_router_pre_softmax  # top-k then softmax over the k: the zoo's renormalised top-k
    assert (ns.moe_router_load_balancing_type, ns.moe_aux_loss_coeff) == (["aux_loss"], [0.01])
    assert (ns.moe_expert_capacity_factor, ns.moe_token_drop_policy, ns.moe_pad_expert_input_to_capacity) == (
        1.25, "position", True)
    assert ns.num_experts % ns.expert_model_parallel_size == 0  # validate_args "moe"
    assert not [d for d in export.differences if d.startswith("expert groups")], export.differences


def test_megatron_writes_zero1_with_ep_as_the_distributed_optimizer_and_fsdp_with_ep_as_it_too(tmp_path):
    """ZeRO-1 with ep is Megatron's distributed optimizer (it shards expert state over the expert-data-
    parallel group, as the plan prices); FSDP2 refuses expert parallelism (validate_args), so a zero 3
    plan with ep is written as the distributed optimizer and says so."""
    for zero, fsdp in ((1, False), (3, True)):
        plan = dataclasses.replace(moe_tp_plan(), zero=zero)
        export = export_plan(plan, "megatron", allow_approx=True)
        ns = parse_megatron(_sourced_args(export.text, tmp_path))
        assert ns.use_distributed_optimizer and not ns.use_torch_fsdp2
        assert any("expert parallelism" in d for d in export.differences) == fsdp


def test_megatron_leaves_the_capacity_out_for_dropless_routing():
    """Dropless routing computes every routed token: no capacity factor (None: nothing dropped)."""
    from autoplan.report.export.common import MoEShape
    from autoplan.report.export.megatron_moe import moe_model_args

    plan = moe_tp_plan()
    dropless = MoEShape(8, 2, 96, 0, 1.0, True, 0.001, True)
    flags = [flag for flag, _ in moe_model_args(plan, dropless, [], 2)]
    assert "--moe-expert-capacity-factor" not in flags and "--moe-pad-expert-input-to-capacity" not in flags
    assert ("--moe-token-dispatcher-type", "alltoall") in moe_model_args(plan, dropless, [], 2)
    capacity = dataclasses.replace(dropless, dropless=False)
    assert ("--moe-expert-capacity-factor", "1.0") in moe_model_args(plan, capacity, [], 2)


@pytest.mark.export
def test_megatron_core_builds_the_moe_config(tmp_path):
    """megatron-core's own TransformerConfig takes the exported MoE fields (its __post_init__ checks
    the capacity factor against the load balancing, the padding against the capacity, top-k against
    the experts), copied by name as core_transformer_config_from_args does (num_experts is its
    num_moe_experts; validate_args turns one-element lists into values)."""
    pytest.importorskip("megatron.core")
    from test_export_megatron import _transformer_config

    ns = parse_megatron(_sourced_args(export_plan(moe_tp_plan(), "megatron", allow_approx=True).text, tmp_path))
    ns.num_moe_experts = ns.num_experts
    ns.moe_router_load_balancing_type = ns.moe_router_load_balancing_type[0]
    ns.moe_aux_loss_coeff = ns.moe_aux_loss_coeff[0]
    config = _transformer_config(ns)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 96)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (8, 1)
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_expert_capacity_factor == 1.25


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


@functools.cache
def moe_cp_plan():
    """The dropless zoo moe at cp 2 x ep 2 (DeepSpeed's config has no cp)."""
    return autoplan.suggest(MOE + ",dropless=true", "1x4xcpu", global_batch=8, seq_len=32, cp=2, ep=2, pp=1,
                            top=1)[0]


@pytest.mark.parametrize("make", [cp_plan, lambda: case("gpt"), moe_cp_plan], ids=["cp", "gpt", "moe-cp2"])
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


def test_the_cli_exports_a_moe_plan_to_torchtitan_and_megatron(tmp_path, capsys):
    """The user's path: `autoplan export moe.json --to torchtitan` exits 2 with one line naming what
    torchtitan runs differently (the zoo's capacity and Switch loss) and `--allow-approx`; with it the
    file states the expert-parallel degree; Megatron-LM's script states its own."""
    from autoplan.cli import main

    path = tmp_path / "moe.json"
    moe_plan().save(path)
    assert main(["export", str(path), "--to", "torchtitan", "--out", str(tmp_path / "t.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autoplan: error: torchtitan cannot run this plan as planned")
    assert "--allow-approx" in err[0] and not (tmp_path / "t.py").exists()
    assert main(["export", str(path), "--to", "torchtitan", "--allow-approx", "--out", str(tmp_path / "t.py")]) == 0
    assert "expert_parallel_degree=2" in (tmp_path / "t.py").read_text()
    assert main(["export", str(path), "--to", "megatron", "--allow-approx", "--out", str(tmp_path / "m.sh")]) == 0
    assert "--expert-model-parallel-size 2" in (tmp_path / "m.sh").read_text()


@pytest.mark.export
def test_torchtitan_builds_the_moe_export_with_the_zoos_parameters(tmp_path):
    """torchtitan's ConfigManager parses the MoE export (its Trainer.Config checks included: no CUDA
    graphs with an all-to-all dispatcher); the model it builds on the meta device holds the zoo model's
    parameter count (attention, experts, router, shared experts, embeddings) and counts its FLOPs as
    the Trainer does (`get_nparams_and_flops`, which needs the heads' width); the expert degree fits
    torchtitan's mesh (dp_shard x cp x tp = efsdp x ep); its pp split gives every pp rank the plan's
    layers. At pp 2 (tp 2 x dp 2) and at pp 1 (dp 4)."""
    import torch
    from test_export_torchtitan import _layers_per_rank, _plan_layers_per_rank

    from autoplan import models as zoo

    spec = MOE + ",num_shared_experts=1,dropless=true"
    plans = {
        "pp2": autoplan.suggest(spec, "1x8xA100-80GB", global_batch=16, seq_len=32, tp=2, pp=2, dp=2, ep=2, zero=3,
                                schedule="1f1b", top=1)[0],
        "pp1": autoplan.suggest(spec, "1x4xA100-80GB", global_batch=16, seq_len=32, tp=1, pp=1, dp=4, ep=2, zero=3,
                                top=1)[0],
    }
    ours = sum(t.numel() for t in zoo.build_model(spec).parameters())
    for name, plan in plans.items():
        config = parse_torchtitan(export_plan(plan, "torchtitan", allow_approx=True).text, tmp_path, f"moe_{name}")
        p = config.parallelism
        assert (p.expert_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree) == (
            2, plan.tp, plan.pp), name
        assert (p.data_parallel_shard_degree * p.context_parallel_degree * p.tensor_parallel_degree) % 2 == 0, name
        model_config = config.model_spec.model
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            built = model_config.build()
        assert sum(t.numel() for t in built.parameters()) == ours, name
        count, flops = model_config.get_nparams_and_flops(built, plan.job.seq_len)
        assert count > 0 and flops > 0, name
        if plan.pp > 1:
            assert _layers_per_rank(config) == _plan_layers_per_rank(plan), name


HF_MIXTRAL = ("hf:mixtral:num_hidden_layers=2,hidden_size=64,intermediate_size=96,num_attention_heads=4,"
              "num_key_value_heads=2,num_local_experts=4,num_experts_per_tok=2,vocab_size=256,max_position_embeddings=128")
HF_QWEN3_MOE = ("hf:qwen3_moe:num_hidden_layers=2,hidden_size=64,intermediate_size=128,moe_intermediate_size=48,"
                "num_attention_heads=4,num_key_value_heads=2,head_dim=16,num_experts=4,num_experts_per_tok=2,"
                "vocab_size=256,max_position_embeddings=128,norm_topk_prob=true")


def _hf_moe_plan(spec, zero=3):
    return autoplan.suggest(spec, "1x4xA100-80GB", global_batch=16, seq_len=32, tp=2, pp=1, dp=2, ep=2, zero=zero,
                            top=1)[0]


@pytest.mark.parametrize("spec", [HF_MIXTRAL, HF_QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def test_transformers_moe_models_export_as_the_targets_moe(spec):
    """transformers' Mixtral and Qwen3-MoE are written as torchtitan's MoE (a Qwen3Model, with Qwen3's
    per-head q/k norm where the model has it) and as Megatron-LM's (--num-experts, --qk-layernorm for
    Qwen3), with their expert layout, exactly (no --allow-approx needed: FSDP for torchtitan, the
    distributed optimizer for Megatron-LM, which runs no FSDP with ep)."""
    plan = _hf_moe_plan(spec)
    titan = export_plan(plan, "torchtitan")
    assert "make_moe_config" in titan.text and "expert_parallel_degree=2" in titan.text
    assert ("qk_norm=RMSNorm.Config(normalized_shape=16" in titan.text) == ("qwen3_moe" in spec)
    assert "route_norm=True" in titan.text
    megatron = export_plan(_hf_moe_plan(spec, zero=1), "megatron").text
    assert "--num-experts 4" in megatron and "--expert-model-parallel-size 2" in megatron
    assert ("--qk-layernorm" in megatron) == ("qwen3_moe" in spec)
    assert "--moe-ffn-hidden-size " + ("48" if "qwen3_moe" in spec else "96") in megatron


def test_a_transformers_moe_the_targets_do_not_build_is_refused_in_one_line():
    """Qwen3-MoE with dense layers between its MoE layers (decoder_sparse_step 2) is not torchtitan's
    MoE: refused, naming the model, with the targets that do write it."""
    plan = _hf_moe_plan(HF_QWEN3_MOE + ",decoder_sparse_step=2")
    with pytest.raises(TargetRefusal, match="torchtitan has no model for hf:qwen3_moe") as refused:
        export_plan(plan, "torchtitan")
    assert "\n" not in str(refused.value)


@pytest.mark.export
@pytest.mark.parametrize("spec", [HF_MIXTRAL, HF_QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def test_torchtitan_builds_the_transformers_moe_export_with_its_parameters(spec, tmp_path):
    """torchtitan's ConfigManager parses the export of a transformers MoE model and builds, on the meta
    device, a model with exactly the parameters transformers' own model has (attention with its q/k
    norms, router, experts, norms, embeddings, head)."""
    import torch

    from autoplan.sources.hf import HFSource

    plan = _hf_moe_plan(spec)
    config = parse_torchtitan(export_plan(plan, "torchtitan").text, tmp_path, spec.split(":")[1])
    assert config.parallelism.expert_parallel_degree == 2
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        built = model_config.build()
        theirs = HFSource.from_spec(spec).build("meta")
    assert sum(t.numel() for t in built.parameters()) == sum(t.numel() for t in theirs.parameters())


@pytest.mark.export
def test_megatron_core_builds_the_qwen3_moe_config(tmp_path):
    """megatron-core's TransformerConfig takes the Megatron export of transformers' Qwen3-MoE: its
    q/k norm (`qk_layernorm`), head width (`kv_channels`), experts and router."""
    pytest.importorskip("megatron.core")
    from test_export_megatron import _transformer_config

    ns = parse_megatron(_sourced_args(export_plan(_hf_moe_plan(HF_QWEN3_MOE, zero=1), "megatron").text, tmp_path))
    ns.num_moe_experts = ns.num_experts
    ns.moe_router_load_balancing_type = ns.moe_router_load_balancing_type[0]
    config = _transformer_config(ns)
    assert config.qk_layernorm and config.kv_channels == 16
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 48)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)


def test_a_transformers_balance_loss_exported_to_megatron_lists_how_its_strength_differs():
    """Issue 43 item 4: transformers pools every layer's router logits into one balancing loss,
    Megatron-LM sums one per MoE layer, so the same coefficient is layers / top-k times stronger
    there: `autoplan export --to megatron` refuses to call that exact and lists it with the
    coefficient that would match (4 layers, top-2: 2x)."""
    spec = HF_MIXTRAL.replace("num_hidden_layers=2", "num_hidden_layers=4") + ",output_router_logits=true"
    plan = autoplan.suggest(spec, "1x4xA100-80GB", global_batch=16, seq_len=32, tp=2, pp=1, dp=2, ep=2, zero=1,
                            top=1)[0]
    export = export_plan(plan, "megatron", allow_approx=True)
    balance = [d for d in export.differences if d.startswith("load-balancing loss: transformers")]
    assert len(balance) == 1 and "about 2x (4 layers / top-2)" in balance[0], export.differences
    assert "--moe-aux-loss-coeff 0.001" in export.text and "0.0005 would be about as strong" in balance[0]
    with pytest.raises(ExportError, match="load-balancing loss"):
        export_plan(plan, "megatron")
    # without output_router_logits the model trains no balancing loss: nothing to list
    plain = autoplan.suggest(HF_MIXTRAL, "1x4xA100-80GB", global_batch=16, seq_len=32, tp=2, pp=1, dp=2, ep=2,
                             zero=1, top=1)[0]
    assert not [d for d in export_plan(plain, "megatron").differences if "load-balancing" in d]
