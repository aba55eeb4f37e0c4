"""Issue 43 item 4: the built-in `qwen3-30b-a3b` preset has Qwen3's per-head q/k RMSNorm (the zoo's
`qk_norm`, off for every other preset), so it is Qwen3-30B-A3B's architecture and its exports build
that architecture: its parameters are counted (transformers' own count of the model, 30.5B total and
3.3B active as published), tp 2 equals one process (the norm's weight whole on each tp rank, its
gradient summed over tp), Megatron-LM's arguments carry `--qk-layernorm` and torchtitan's model a
`qk_norm` over each head. The `export` tests read the files with megatron-core and torchtitan.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import pytest
import torch
from _dist import run_ranks

import autoplan
from autoplan import models as zoo
from autoplan.graph.aux_loss import aux_loss_scale, recording_aux_losses
from autoplan.report.export import export_plan

QWEN3 = "qwen3-30b-a3b"
TINY = (f"{QWEN3}:num_layers=2,hidden_size=64,num_heads=4,num_kv_heads=2,head_size=16,ffn_hidden_size=32,"
        "vocab_size=256,max_seq_len=64,num_experts=4,experts_per_token=2")
"""The preset's architecture (q/k norm, head size apart from hidden / heads, GQA, experts) at a size
that runs on two CPU ranks in seconds."""
GLOBAL_BATCH, SEQ_LEN, MICRO_BATCH = 4, 16, 2


def _active(model: torch.nn.Module, config: zoo.MoEConfig) -> int:
    """Parameters one token passes through: all but the routed experts it is not sent to."""
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    total = sum(p.numel() for p in model.parameters())
    return total - experts + experts * config.experts_per_token // config.num_experts


def test_the_preset_has_qwen3s_qk_norm_and_the_published_size():
    """`autoplan list models` counts Qwen3-30B-A3B at its model card's 30.5B parameters, 3.3B active,
    29.9B non-embedding (huggingface.co/Qwen/Qwen3-30B-A3B), its q/k norms included: one RMSNorm of head size 128 for
    queries and one for keys in each of the 48 layers. No other preset has them."""
    out = subprocess.run([sys.executable, "-m", "autoplan", "list", "models", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    total = rows[QWEN3]["num_params"]
    model = zoo.build_model(QWEN3)  # on meta
    config = zoo.PRESETS[QWEN3]
    active = _active(model, config)
    print(f"{QWEN3}: {total:,} parameters ({total / 1e9:.2f}B), {active:,} active ({active / 1e9:.2f}B)")
    # The card's figures, to the 0.1B it gives (3.35B active is written 3.3B); 29.9B without the
    # embedding and the output layer.
    embeddings = 2 * config.vocab_size * config.hidden_size
    assert [int(n / 1e8) / 10 for n in (total, active, total - embeddings)] == [30.5, 3.3, 29.9]
    assert sum(p.numel() for p in model.parameters()) == total
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for layer in range(config.num_layers):
        assert shapes[f"layers.{layer}.attention.q_norm.weight"] == shapes[f"layers.{layer}.attention.k_norm.weight"] \
            == (128,)
    without = zoo.build_model(f"{QWEN3}:qk_norm=false")
    assert total - sum(p.numel() for p in without.parameters()) == 2 * 128 * 48
    assert [name for name, c in zoo.PRESETS.items() if getattr(c, "qk_norm", False)] == [QWEN3]


@pytest.mark.hf
def test_the_preset_counts_what_transformers_qwen3_moe_counts():
    """transformers' Qwen3MoeForCausalLM of Qwen/Qwen3-30B-A3B's config.json has exactly the zoo
    preset's parameters, and its attention the same q/k norms (`self_attn.q_norm.weight`)."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Qwen/Qwen3-30B-A3B config.json: the fields that size the model.
    hf = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
              num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
              max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
              mlp_only_layers=[])

    def count(layers: int) -> tuple[int, dict[str, tuple[int, ...]]]:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_hidden_layers=layers, **hf))
        return sum(p.numel() for p in model.parameters()), {n: tuple(p.shape) for n, p in model.named_parameters()}

    (one, shapes), (two, _) = count(1), count(2)
    theirs = one + 47 * (two - one)  # every layer alike
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == shapes["model.layers.0.self_attn.k_norm.weight"] == (128,)
    ours = zoo.build_model(QWEN3)
    assert sum(p.numel() for p in ours.parameters()) == theirs
    assert dict(ours.named_parameters())["layers.0.attention.q_norm.weight"].shape == (128,)


def test_the_norms_are_initialized_traced_and_counted_by_the_profile():
    """The q/k norm weights start at one (models/init.py: norm scales), the profile `suggest` searches
    counts them (2 x head size a layer), and its tensor-parallel layout shards the attention with them."""
    model = zoo.build_model(TINY, device="cpu", seed=0)
    for layer in model.layers:
        assert torch.equal(layer.attention.q_norm.weight, torch.ones(16))
        assert torch.equal(layer.attention.k_norm.weight, torch.ones(16))
    with_norm, without = (autoplan.profile(spec, seq_len=SEQ_LEN) for spec in (TINY, TINY + ",qk_norm=false"))
    assert with_norm.num_params == sum(p.numel() for p in model.parameters())
    assert with_norm.num_params - without.num_params == 2 * 2 * 16
    layout = with_norm.extra["tensor_parallel"]
    assert layout["replicated"] == {} and layout["divides"]["num_heads"] == 4, layout


# ---- tp 2 equals one process ---------------------------------------------------------------------

@functools.cache
def _plans() -> dict:
    pins = dict(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH, dtype="fp32", tp=2, pp=1,
                dp=1, ep=1, top=1)
    return {"tp2": autoplan.suggest(TINY, "1x2xcpu", sequence_parallel=False, **pins)[0],
            "tp2-sp": autoplan.suggest(TINY, "1x2xcpu", sequence_parallel=True, **pins)[0]}


def _rank_job(rank: int, world_size: int, plans: dict) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, plan in plans.items():
        pm = autoplan.partition(plan.model, plan, device="cpu")
        template = pm.output_template
        inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
        loss = pm.step(*inputs, target=target)
        params = dict(pm.named_parameters())
        out[name] = {
            "loss": None if loss is None else float(loss),
            "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                      for n, p in params.items() if p.grad is not None},
            "local_shapes": {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in params.items()},
            "batch": (inputs, target),
        }
    return out


def _reference(plan, inputs, target) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (load-balancing losses included) and gradients of the whole model, one process."""
    from autoplan.sources import parse_source

    source = parse_source(plan.model)
    model = source.build("cpu")
    chunks = plan.job.global_batch // plan.micro_batch_size
    rows = plan.micro_batch_size
    total = 0.0
    for k in range(chunks):
        loss = source.loss_fn(model(inputs[0][k * rows:(k + 1) * rows]), target[k * rows:(k + 1) * rows]) / chunks
        with aux_loss_scale(1 / chunks), recording_aux_losses() as aux:
            loss.backward()
        total += loss.item() + sum(float(a) for a in aux)
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_tp2_with_qk_norm_equals_one_process():
    """At tp 2 (and tp 2 with sequence parallelism) each rank holds half of every attention
    projection and the whole q/k norm weights (head size 16), normalizes its own heads with them, and
    the loss and every gradient, the norms' included (summed over the tp ranks), equal one process's."""
    plans = _plans()
    for name, plan in plans.items():
        assert (plan.tp, plan.pp, plan.dp, plan.sequence_parallel) == (2, 1, 1, name == "tp2-sp")
    results = run_ranks(_rank_job, 2, plans, timeout_s=600, pg_timeout_s=120)
    for name, plan in plans.items():
        inputs, target = results[0][name]["batch"]
        ref_loss, ref_grads = _reference(plan, inputs, target)
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        for rank in (0, 1):
            res = results[rank][name]
            assert res["loss"] == pytest.approx(ref_loss, rel=1e-4), (name, rank)
            assert set(res["grads"]) == set(ref_grads), (name, rank)
            for param, grad in res["grads"].items():
                torch.testing.assert_close(grad, ref_grads[param], rtol=1e-4, atol=1e-4 * scale,
                                           msg=lambda m, p=param, r=rank, n=name: f"{n} rank {r} {p}: {m}")
            shapes = res["local_shapes"]
            for layer in range(2):
                prefix = f"layers.{layer}.attention."
                assert shapes[prefix + "wq.weight"] == (2 * 16, 64) and shapes[prefix + "wk.weight"] == (16, 64)
                assert shapes[prefix + "q_norm.weight"] == shapes[prefix + "k_norm.weight"] == (16,)
        norm_grads = [results[r][name]["grads"]["layers.0.attention.q_norm.weight"] for r in (0, 1)]
        assert norm_grads[0].abs().sum() > 0 and torch.equal(norm_grads[0], norm_grads[1])


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_tp2_dp2_and_tp2_pp2_with_qk_norm_equal_one_process():
    """The user-path matrix's tp layouts on 4 ranks (tests/test_user_paths.py): tp 2 x dp 2 and
    tp 2 x pp 2, loss and every gradient against one process."""
    from test_user_paths import LAYOUTS, _check_spec

    _check_spec(TINY, 32, {k: LAYOUTS[k] for k in ("tp2", "tp2-pp2")}, set())


# ---- exports -------------------------------------------------------------------------------------

@functools.cache
def _qwen3_plan():
    """A plan of the preset itself on 64 H100 (the issue's job), pinned so the search is short."""
    return autoplan.suggest(QWEN3, "8x8xH100-80GB", global_batch=256, seq_len=4096, tp=2, pp=2, ep=8, zero=1,
                            schedule="1f1b", top=1)[0]


def test_the_megatron_export_of_the_preset_has_qk_layernorm():
    """Megatron-LM's arguments build Qwen3's attention: --qk-layernorm (an RMSNorm, the model's
    --normalization, over each head's --kv-channels 128); torchtitan's model a qk_norm of 128."""
    plan = _qwen3_plan()
    megatron = export_plan(plan, "megatron", allow_approx=True).text
    assert "--qk-layernorm" in megatron.split() and "--normalization RMSNorm" in megatron
    assert "--kv-channels 128" in megatron
    titan = export_plan(plan, "torchtitan", allow_approx=True).text
    assert "qk_norm=RMSNorm.Config(normalized_shape=128, eps=1e-06" in titan
    # A model without the norm gets none (the option is off by default).
    other = dataclasses.replace(plan, model=f"{QWEN3}:qk_norm=false")
    assert "--qk-layernorm" not in export_plan(other, "megatron", allow_approx=True).text.split()
    assert "qk_norm=RMSNorm" not in export_plan(other, "torchtitan", allow_approx=True).text


def test_a_dense_llama_with_qk_norm_is_not_written_as_a_llama3_flavor():
    """A Llama 3 8B shape with `qk_norm` is not torchtitan's llama3 `8B` flavor (which has no q/k
    norm): the file builds the layers with the norm."""
    plan = autoplan.suggest("llama3-8b:qk_norm=true", "1x8xH100-80GB", global_batch=8, seq_len=1024, tp=8, pp=1,
                            top=1)[0]
    titan = export_plan(plan, "torchtitan", allow_approx=True).text
    assert "model_registry('8B')" not in titan and "qk_norm=RMSNorm.Config(normalized_shape=128" in titan
    assert "--qk-layernorm" in export_plan(plan, "megatron", allow_approx=True).text.split()


@pytest.mark.export
def test_megatron_core_takes_the_presets_qk_layernorm(tmp_path):
    """megatron-core's TransformerConfig, from the export as Megatron-LM's arguments parse it, has
    `qk_layernorm` with RMSNorm over heads of 128."""
    pytest.importorskip("megatron.core")
    from test_export_megatron import _parse, _sourced_args, _transformer_config

    ns = _parse(_sourced_args(export_plan(_qwen3_plan(), "megatron", allow_approx=True).text, tmp_path))
    ns.num_moe_experts = ns.num_experts
    ns.moe_router_load_balancing_type = ns.moe_router_load_balancing_type[0]
    config = _transformer_config(ns)
    assert config.qk_layernorm and config.kv_channels == 128 and config.normalization == "RMSNorm"


@pytest.mark.export
def test_torchtitan_builds_the_presets_qk_norm_with_the_zoos_parameters(tmp_path):
    """torchtitan's ConfigManager parses the export of the preset's architecture (at the tiny size)
    and builds, on meta, a model with the zoo model's parameter count and a q/k norm of head size in
    every layer's attention."""
    pytest.importorskip("torchtitan")
    from test_export_torchtitan import _parse

    plan = autoplan.suggest(TINY, "1x4xA100-80GB", global_batch=16, seq_len=32, tp=2, pp=1, dp=2, ep=2, top=1)[0]
    config = _parse(export_plan(plan, "torchtitan", allow_approx=True).text, tmp_path, "autoplan_qwen3_tiny")
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        built = model_config.build()
    ours = zoo.build_model(TINY)
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in ours.parameters())
    norms = {n: tuple(p.shape) for n, p in built.named_parameters() if "q_norm" in n or "k_norm" in n}
    assert len(norms) == 2 * 2 and set(norms.values()) == {(16,)}, norms
