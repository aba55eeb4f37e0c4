"""Mixture-of-experts models and expert parallelism: the zoo family, the profile's experts, the
search's ep dimension and its explanation, the user's CLI path (`suggest --ep ... --out` then
`autoplan run`), and the refusals. Numerics against a single-process reference are in
tests/test_expert_parallel.py (and tests/test_user_paths.py runs the zoo MoE in every layout)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from _cli import run_main
from conftest import scaled_timeout_s

import autoplan
from autoplan import models as zoo
from autoplan.graph.aux_loss import aux_loss_scale
from autoplan.plan import validate
from autoplan.report.export import ExportError, export_plan
from autoplan.runtime.checkpoint.format import step_dir_name

TINY = ("moe:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=96,vocab_size=256,max_seq_len=64,"
        "num_experts=4,experts_per_token=2")


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("name", "billions"), [("mixtral-8x7b", 46.70), ("mixtral-8x22b", 140.63),
                                                ("qwen3-30b-a3b", 30.53)])
def test_presets_have_the_published_parameter_counts(name, billions):
    """Mixtral 8x7B: 46.7B (arXiv:2401.04088 Sec. 2); 8x22B: 141B; Qwen3-30B-A3B: 30.5B (its model
    card), its per-head q/k norms included (tests/test_qk_norm_preset.py)."""
    model = zoo.build_model(name)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert name in zoo.PRESET_SOURCES


def test_moe_spec_errors_are_one_line():
    for spec, words in [("moe:num_layers=2,hidden_size=64,num_heads=4,num_experts=4,experts_per_token=5",
                         "experts_per_token 5 exceeds num_experts 4"),
                        ("moe:num_layers=2,hidden_size=64,num_heads=4,router_aux_loss_coef=-1", "must be 0 or more"),
                        ("moe:num_layers=2,hidden_size=64,num_heads=4,num_experts=99999", "at most"),
                        ("moe:num_layers=2,hidden_size=64,num_heads=4,capacity_factor=0", "must be positive")]:
        with pytest.raises(zoo.ModelSpecError, match=words) as info:
            zoo.parse_model_spec(spec)
        assert "\n" not in str(info.value)


def test_capacity_drops_tokens_past_it_and_keeps_them_below():
    assert zoo.expert_capacity(4096, 2, 8, 1.25) == 1280  # GShard: ceil(1.25 * 4096 * 2 / 8)
    assert zoo.expert_capacity(16, 2, 4, 100.0) == 16  # never more than the sequence
    spec = "moe:num_layers=1,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=32,num_experts=4,experts_per_token=2"
    roomy = zoo.build_model(spec + ",capacity_factor=2", device="cpu")  # capacity = seq_len: nothing dropped
    tight = zoo.build_model(spec + ",capacity_factor=0.25", device="cpu")
    x = torch.randn(2, 16, 32)
    full, dropped = roomy.layers[0].moe(x), tight.layers[0].moe(x)
    # Same weights (name-keyed init); with capacity 2 of 16 most picks skip their expert.
    assert not torch.allclose(full, dropped)
    assert (dropped.abs().sum(-1) == 0).sum() > 0  # tokens that lost both experts get nothing from the MoE


def test_load_balancing_loss_is_invariant_to_micro_batching():
    """Per-sequence capacity and balance loss ([Note: static dispatch]): two micro-batches of half
    the batch, each loss scaled by 1/2 and its auxiliary losses too, give the whole batch's gradients."""
    spec = TINY + ",num_shared_experts=1"
    model = zoo.build_model(spec, device="cpu")
    ids, targets = zoo.example_inputs(spec, 4, 16, device="cpu")[0], zoo.example_targets(spec, 4, 16, device="cpu")
    zoo.lm_loss(model(ids), targets).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with aux_loss_scale(0.5):
        for half in (slice(0, 2), slice(2, 4)):
            (zoo.lm_loss(model(ids[half]), targets[half]) * 0.5).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], rtol=1e-5, atol=1e-7)
    # The router's gradient includes the balance loss: without it the gradient differs.
    plain = zoo.build_model(spec + ",router_aux_loss_coef=0", device="cpu")
    zoo.lm_loss(plain(ids), targets).backward()
    assert not torch.allclose(plain.layers[0].moe.router.weight.grad, whole["layers.0.moe.router.weight"])


def test_profile_records_experts_and_their_dispatch_bytes():
    profile = autoplan.profile(TINY, seq_len=32)
    experts = profile.extra["experts"]
    assert experts["num_experts"] == 4
    layers = [i for i, b in enumerate(profile.blocks) if b.name.startswith("layers.")]
    assert [experts["block_params"][i] for i in layers] == [3 * 4 * 64 * 96] * 4
    capacity = zoo.expert_capacity(32, 2, 4, 1.25)
    batch = profile.batch_size
    # (experts, batch * capacity, hidden) in bf16, per layer
    assert [experts["block_dispatch_bytes"][i] for i in layers] == [4 * batch * capacity * 64 * 2] * 4
    assert experts["block_params"][0] == 0 and experts["block_dispatch_bytes"][0] == 0


def test_expert_parallelism_halves_the_experts_memory_and_adds_all_to_all():
    common = dict(global_batch=8, seq_len=32, dtype="fp32", tp=1, pp=1, dp=4, micro_batch_size=2, zero=0,
                  schedule="1f1b", recompute="none")
    one = autoplan.suggest(TINY, "1x4xA100-80GB", ep=1, **common)[0]
    two = autoplan.suggest(TINY, "1x4xA100-80GB", ep=2, **common)[0]
    experts = sum(autoplan.profile(TINY, seq_len=32, dtype="fp32").extra["experts"]["block_params"])
    assert one.stages[0].num_params - two.stages[0].num_params == pytest.approx(experts / 2, rel=1e-6)
    assert two.predicted.breakdown["ep_comm_s"] > 0 and "ep_comm_s" not in one.predicted.breakdown
    assert two.ep == 2 and one.ep == 1


def test_fsdp_shards_each_gpus_experts_over_the_replicas_holding_them():
    """Under FSDP a GPU's 1/ep of the experts is sharded over the dp / ep replicas that hold the
    same experts (runtime/parallel/fsdp.py), so the weights, gradients and Adam state per GPU are those of
    FSDP without ep; the all-to-all is added, and the gathered experts are 1/ep of them."""
    common = dict(global_batch=8, seq_len=32, dtype="fp32", tp=1, pp=1, dp=4, micro_batch_size=2, zero=3,
                  schedule="1f1b", recompute="none")
    one = autoplan.suggest(TINY, "1x4xA100-80GB", ep=1, **common)[0]
    two = autoplan.suggest(TINY, "1x4xA100-80GB", ep=2, **common)[0]
    assert (two.ep, two.zero, one.ep, one.zero) == (2, 3, 1, 3)
    for field in ("weights_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(two.stages[0].memory, field) == pytest.approx(getattr(one.stages[0].memory, field), rel=1e-6)
    assert two.predicted.breakdown["ep_comm_s"] > 0


def test_mixtral_8x22b_on_256_h100_searches_expert_parallelism_and_says_why():
    started = time.perf_counter()
    result = run_main("suggest", "--model", "mixtral-8x22b", "--cluster", "32x8xH100-80GB", "--global-batch", "1024",
                      "--seq-len", "4096", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # a guard against a search that explodes, not a speed target: scaled by the load ([Note: timeouts under load])
    assert data["search"]["time_s"] < scaled_timeout_s(10), data["search"]["time_s"]
    notes = " ".join(data["search"]["notes"])
    assert "ep " in notes and "expert parallelism" in notes, notes  # the choice and its alternative
    pinned = autoplan.suggest("mixtral-8x22b", "32x8xH100-80GB", global_batch=1024, seq_len=4096, ep=8, top=1)[0]
    assert pinned.ep == 8 and pinned.dp_replicate == 1 and pinned.fits
    (note,) = [note for note in pinned.notes if note.startswith("ep 8 (pinned)")]
    # the ep group folded over tp x dp: one node's 8 ranks (plan.py [Note: expert layout])
    assert "all-to-all over ranks 0, 1, ..., 7 (1 node: 7 peers over NVLink)" in note, note
    assert time.perf_counter() - started < scaled_timeout_s(120)


def test_plan_validation_knows_ep():
    plan = autoplan.suggest(TINY, "1x4xcpu", global_batch=8, seq_len=32, ep=2, pp=1, top=1)[0]
    assert validate(plan) == []
    import dataclasses

    assert any("ep 3 must divide tp x dp = 4" in p for p in validate(dataclasses.replace(plan, ep=3)))
    assert validate(dataclasses.replace(plan, zero=1)) == []  # experts' state over their replicas (issue 31)
    assert plan.tp * plan.dp == 4
    hsdp = dataclasses.replace(plan, zero=3, dp_replicate=2)  # each replica group of 2 ranks holds every expert
    assert validate(hsdp) == []
    assert any("under HSDP" in p for p in validate(dataclasses.replace(hsdp, ep=4)))  # ep 4 spans both groups
    assert validate(dataclasses.replace(plan, zero=3)) == []


def test_exports_refuse_what_they_cannot_state():
    plan = autoplan.suggest(TINY, "1x4xcpu", global_batch=8, seq_len=32, ep=2, pp=1, top=1)[0]
    for target in ("torchtitan", "megatron"):
        with pytest.raises(ExportError):  # no dense Llama shape for a mixture of experts
            export_plan(plan, target)
    with pytest.raises(ExportError, match="ep 2"):
        export_plan(plan, "deepspeed")
    approx = export_plan(plan, "deepspeed", allow_approx=True)
    assert any(d.startswith("ep 2") for d in approx.differences)


@pytest.mark.parametrize(("args", "words"), [
    (["--ep", "3"], "--ep 3 does not divide the model's 4 experts"),
    (["--ep", "4", "--tp", "1", "--dp", "4", "--zero", "3", "--dp-replicate", "2"],
     "--ep 4 must divide tp x dp_shard = 2 under HSDP"),
    (["--ep", "8"], "does not divide the model's 4 experts"),
])
def test_suggest_refuses_bad_ep_pins_in_one_line(args, words, capsys):
    # The CLI's entry point in this process (a fresh `python -m autoplan` per case cost ~10 s of the suite).
    from autoplan.cli import main

    code = main(["suggest", "--model", TINY, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32", *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pins", "expected"), [
    (["--pp", "2"], dict(ep=2, pp=2, dp=2)),
    # experts sharded by FSDP too, under tp 2: the ep group folded over tp x dp (plan.py [Note: expert layout])
    (["--tp", "2", "--pp", "1", "--zero", "3"], dict(ep=2, tp=2, pp=1, dp=2, zero=3, expert_tp=1)),
])
def test_suggest_with_ep_then_autoplan_run(tmp_path, pins, expected):
    """The user's path: `suggest --ep 2 --out`, then `autoplan run` on 4 local ranks (defaults: bf16,
    the source's synthetic data) with checkpoints every 2 steps; resumed from step 2, it gives the
    same losses ([Note: experts in a checkpoint] in runtime/checkpoint/state.py)."""
    out = tmp_path / "moe.json"
    result = run_cli("suggest", "--model", TINY, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32",
                     "--ep", "2", *pins, "--out", str(out))
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert {k: plan[k] for k in expected} == expected
    checkpoints = tmp_path / "ckpt"
    run = run_cli("run", str(out), "--steps", "4", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2",
                  "--metrics", str(tmp_path / "straight.jsonl"))
    assert run.returncode == 0 and "step 3" in run.stdout, run.stderr[-2000:]
    shutil.rmtree(checkpoints / step_dir_name(4))
    resumed = run_cli("run", str(out), "--steps", "4", "--checkpoint-dir", str(checkpoints), "--resume",
                      "--metrics", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight, again = (_step_losses(tmp_path / f) for f in ("straight.jsonl", "resumed.jsonl"))
    assert sorted(again) == [2, 3] and all(again[s] == straight[s] for s in again), (straight, again)


def _step_losses(path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, path.read_text().splitlines()) if m.get("loss") is not None}
