"""Pretrained weights in and Hugging Face weights out (issue 41 items 1 and 6): a small transformers
Llama and Mixtral saved with `save_pretrained` (safetensors, one file or several shards), planned
with `autoplan.suggest("hf:DIR", ...)`, partitioned on 4 gloo ranks and loaded by
`autoplan.runtime.checkpoint.weights.load_weights` (each rank reads its boxes: tp shards, fused q/k/v, pipeline
stages, FSDP shards, expert slices under ep); the first step's loss equals transformers' own loss of
the loaded model on the same batch. The ep fix of `PartitionedModel.load_state_dict`
(`load_state_dict_slices`) is checked the same way, and an autoplan checkpoint exported with
`export_hf` reloads in transformers with the partitioned model's logits."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import autoplan
from autoplan.runtime.checkpoint.weights import (
    WeightsError,
    check_weights,
    load_state_dict_slices,
    load_weights,
    open_weights,
)
from autoplan.sources import parse_source

SEQ_LEN = 32
GLOBAL_BATCH = 8
LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128)
MIXTRAL = dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)


def _save(kind: str, directory, *, max_shard_size: str | None = None, seed: int = 1, **overrides) -> str:
    """A random transformers model saved with save_pretrained (safetensors); its directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config_class, model_class, sizes = {"llama": (LlamaConfig, LlamaForCausalLM, LLAMA),
                                        "mixtral": (MixtralConfig, MixtralForCausalLM, MIXTRAL)}[kind]
    model = model_class(config_class(**{**sizes, **overrides}))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return str(directory)


def _plan(directory: str, out, **pins):
    pins = {"dtype": "fp32", **pins}
    plan = autoplan.suggest(f"hf:{directory}", "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN,
                            micro_batch_size=2, top=1, **pins)[0]
    plan.save(out)
    return str(out)


def _transformers_loss(directory: str, inputs, target) -> float:
    """transformers' own loss of the saved model: autoplan's targets are already each position's next
    token, so they go in as `shift_labels` (with `labels` alone transformers shifts them again)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.train()  # as autoplan steps it (no dropout in these configs)
    with torch.no_grad():
        return float(model(*inputs, labels=target, shift_labels=target).loss)


def _step(pm, rank: int) -> dict:
    plan, template = pm.plan, pm.output_template
    inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    loss = pm.step(*inputs, target=target)
    return dict(loss=None if loss is None else float(loss), batch=(inputs, target) if rank == 0 else None)


def _load_job(rank: int, world_size: int, cases: dict) -> dict:
    """Each case: (model dir, plan file, how): partition with random init, then load the weights."""
    out = {}
    for name, (directory, plan, how) in cases.items():
        pm = autoplan.partition(f"hf:{directory}", plan, device="cpu", seed=7)  # other values than the file's
        if how == "state_dict":  # the full state dict, as a user holds it in memory
            from transformers import AutoModelForCausalLM

            full = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
            load_state_dict_slices(pm, full, strict=True)
        else:
            load_weights(pm, how)
        out[name] = _step(pm, rank)
    return out


def _check_losses(cases: dict, results: dict) -> None:
    for name, (directory, _, _) in cases.items():
        inputs, target = results[0][name]["batch"]
        expected = _transformers_loss(directory, inputs, target)
        losses = [r[name]["loss"] for r in results.values() if r[name]["loss"] is not None]
        assert losses, name
        for loss in losses:
            assert loss == pytest.approx(expected, rel=1e-6), (name, losses, expected)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_llama_safetensors_load_at_tp2_pp2_and_fsdp(tmp_path):
    """One model.safetensors at tp 2 x pp 2 (q/k/v, gate/up column shards, stages); several shards
    with an index under FSDP (zero 3, dp 4): the first loss is transformers' own."""
    one = _save("llama", tmp_path / "llama")
    sharded = _save("llama", tmp_path / "llama-sharded", max_shard_size="40KB")
    assert (tmp_path / "llama-sharded" / "model.safetensors.index.json").is_file()
    cases = {"tp2-pp2": (one, _plan(one, tmp_path / "a.json", tp=2, pp=2), one),
             "fsdp-dp4-sharded": (sharded, _plan(sharded, tmp_path / "b.json", tp=1, pp=1, dp=4, zero=3), sharded)}
    results = run_ranks(_load_job, 4, cases, timeout_s=240, pg_timeout_s=120)
    _check_losses(cases, results)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_mixtral_loads_at_ep2_from_safetensors_and_from_a_full_state_dict(tmp_path):
    """Mixtral's checkpoint holds one tensor per expert and projection (transformers' original
    layout); the model stacks them (`experts.gate_up_proj`): each ep rank reads its experts' parts.
    The full state dict loads at ep 2 too (it raised "size of tensor a (2) must match ... (4)")."""
    directory = _save("mixtral", tmp_path / "mixtral")
    plan = _plan(directory, tmp_path / "ep2.json", tp=1, pp=1, dp=4, ep=2)
    cases = {"ep2-safetensors": (directory, plan, directory), "ep2-state-dict": (directory, plan, "state_dict")}
    results = run_ranks(_load_job, 4, cases, timeout_s=240, pg_timeout_s=120)
    _check_losses(cases, results)


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_mixtral_loads_at_ep2_expert_tp2_and_fsdp(tmp_path):
    """ep 2 x expert tp 2 (each expert's [gate | up] halves split by hidden unit) and ep 2 under
    FSDP (the experts' slices sharded again), from several safetensors shards."""
    directory = _save("mixtral", tmp_path / "mixtral", max_shard_size="60KB")
    cases = {"ep2-etp2": (directory, _plan(directory, tmp_path / "a.json", tp=2, pp=1, dp=2, ep=2, expert_tp=2),
                          directory),
             "ep2-zero3": (directory, _plan(directory, tmp_path / "b.json", tp=1, pp=1, dp=4, ep=2, zero=3),
                           directory)}
    results = run_ranks(_load_job, 4, cases, timeout_s=360, pg_timeout_s=120)
    _check_losses(cases, results)


def test_lazy_expert_reads_equal_the_stacked_tensor(tmp_path):
    """A box of a stacked experts tensor read from the per-expert file is that box of the model's
    own tensor (experts 1-2, rows spanning the gate and up halves)."""
    from transformers import AutoModelForCausalLM

    directory = _save("mixtral", tmp_path / "m", max_shard_size="60KB")
    full = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    source = open_weights(directory)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert source.shapes[name] == tuple(full[name].shape) == (4, 192, 64)
    torch.testing.assert_close(source.read(name, (1, 80, 3), (2, 40, 20)), full[name][1:3, 80:120, 3:23],
                               rtol=0, atol=0)
    assert set(source.shapes) == set(full), set(source.shapes) ^ set(full)
    check_weights(parse_source(f"hf:{directory}"), directory)  # names and shapes of the whole model agree


def test_qwen2_moe_checkpoint_reads_as_the_model_holds_it(tmp_path):
    """Qwen2-MoE's per-expert gate/up/down tensors (and its shared expert, kept as it is) read whole
    as the stacked tensors transformers' own loading makes."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(**{**LLAMA, "intermediate_size": 64}, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path / "q", safe_serialization=True, max_shard_size="50KB")
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).state_dict()
    source = open_weights(tmp_path / "q")
    assert set(source.shapes) == set(full), set(source.shapes) ^ set(full)
    for name, tensor in full.items():
        assert torch.equal(source.read(name, (0,) * tensor.dim(), tuple(tensor.shape)), tensor), name
    check_weights(parse_source(f"hf:{tmp_path / 'q'}"), tmp_path / "q")


def _one_process_pm(directory: str, tmp_path):
    plan = autoplan.suggest(f"hf:{directory}", "1x1xcpu", global_batch=2, seq_len=SEQ_LEN, dtype="fp32", top=1)[0]
    return autoplan.partition(f"hf:{directory}", plan, device="cpu")


def test_mismatched_weights_name_the_first_key_in_one_line(tmp_path):
    """Another config's weights (a wider vocabulary), weights missing a layer, and extra tensors:
    one line each, naming the tensor."""
    directory = _save("llama", tmp_path / "llama")
    other = _save("llama", tmp_path / "wide", vocab_size=512)
    deeper = _save("llama", tmp_path / "deep", num_hidden_layers=3)
    pm = _one_process_pm(directory, tmp_path)
    with pytest.raises(WeightsError, match=r"'model.embed_tokens.weight' has shape \(512, 64\), this model's "
                                           r"\(256, 64\); load weights of the model") as info:
        load_weights(pm, other)
    assert "\n" not in str(info.value)
    with pytest.raises(WeightsError, match=str(info.value).replace("(", r"\(").replace(")", r"\)")):
        check_weights(parse_source(f"hf:{directory}"), other)  # the same line before any rank starts
    check_weights(parse_source(f"hf:{directory}"), directory)
    with pytest.raises(WeightsError, match=r"hold 'model.layers.2.\S+' \(9 tensors in all\), which this model has no "):
        load_weights(pm, deeper)
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    del full["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(WeightsError, match=r"have no tensor 'model.layers.1.mlp.down_proj.weight' \(1 of this rank"):
        load_state_dict_slices(pm, full, strict=True)
    assert load_state_dict_slices(pm, full) == ["model.layers.1.mlp.down_proj.weight"]
    torch.save(full, tmp_path / "sd.pt")
    with pytest.raises(WeightsError, match="have no tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_weights(pm, tmp_path / "sd.pt")


def _export_job(rank: int, world_size: int, directory: str, plan: str, other_plan: str, ckpt_dir: str) -> dict:
    from autoplan.runtime.checkpoint import save_checkpoint

    pm = autoplan.partition(f"hf:{directory}", plan, device="cpu")
    load_weights(pm, directory)
    optimizer = pm.make_optimizer(torch.optim.SGD, lr=0.1)
    out = _step(pm, rank)
    optimizer.step()  # weights no longer the initial ones
    save_checkpoint(ckpt_dir, 1, pm, optimizer)
    out["after"] = _step(pm, rank)["loss"]  # the loss of the saved weights
    # The checkpoint as initial weights of another layout (FSDP, dp 4).
    other = autoplan.partition(f"hf:{directory}", other_plan, device="cpu")
    load_weights(other, ckpt_dir)
    out["other"] = _step(other, rank)["loss"]
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_export_hf_reloads_in_transformers_with_the_partitioned_models_loss(tmp_path):
    """Load at tp 2 x pp 2, train one step, checkpoint, `export_hf` (sharded: several files and an
    index); `AutoModelForCausalLM.from_pretrained` gives the loss the partitioned model computes on
    the saved weights, and its logits equal those of the checkpoint's state dict in the plain model.
    The checkpoint, given to `load_weights` under FSDP (dp 4), gives that loss too."""
    from transformers import AutoModelForCausalLM

    from autoplan.runtime.checkpoint import load_full_state_dict
    from autoplan.runtime.checkpoint.hf_export import export_hf

    directory = _save("llama", tmp_path / "llama")
    plan = _plan(directory, tmp_path / "p.json", tp=2, pp=2)
    other = _plan(directory, tmp_path / "q.json", tp=1, pp=1, dp=4, zero=3)
    results = run_ranks(_export_job, 4, directory, plan, other, str(tmp_path / "ckpt"), timeout_s=240,
                        pg_timeout_s=120)
    check_weights(parse_source(f"hf:{directory}"), tmp_path / "ckpt")  # a checkpoint's metadata, as --init checks it
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    inputs, target = results[0]["batch"]
    with torch.no_grad():
        loss = float(model(*inputs, labels=target, shift_labels=target).loss)
    after = [r["after"] for r in results.values() if r["after"] is not None]
    assert after and all(a == pytest.approx(loss, rel=1e-6) for a in after), (after, loss)
    other = [r["other"] for r in results.values()]  # dp 4: every rank is a last stage
    assert all(o == pytest.approx(loss, rel=1e-6) for o in other), (other, loss)
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    # The checkpoint also holds the stages' rotary buffers, which transformers computes (non-persistent).
    result = plain.load_state_dict(load_full_state_dict(tmp_path / "ckpt"), strict=False)
    assert not result.missing_keys and all(k.endswith("inv_freq") for k in result.unexpected_keys), result
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs).logits, plain(*inputs).logits, rtol=0, atol=0)


def test_export_hf_of_a_tied_mixtral_writes_one_embedding(tmp_path):
    """One process: a tied Mixtral's checkpoint exports the embedding once (transformers ties it again)
    and the experts stacked; from_pretrained gives the loaded weights' logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from autoplan.runtime.checkpoint import save_checkpoint
    from autoplan.runtime.checkpoint.hf_export import export_hf

    directory = _save("mixtral", tmp_path / "m", tie_word_embeddings=True)
    pm = _one_process_pm(directory, tmp_path)
    load_weights(pm, directory)
    save_checkpoint(tmp_path / "ckpt", 1, pm)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_export_hf_refuses_a_used_out_directory(tmp_path):
    from autoplan.runtime.checkpoint import CheckpointError
    from autoplan.runtime.checkpoint.hf_export import export_hf

    directory = _save("llama", tmp_path / "llama")
    pm = _one_process_pm(directory, tmp_path)
    from autoplan.runtime.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "ckpt", 1, pm)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_hf(tmp_path / "ckpt", tmp_path / "used")


def _values_job(rank: int, world_size: int, directory: str, plans: dict) -> dict:
    """Each plan: after `load_weights`, this rank's parameters, whole (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, plan in plans.items():
        pm = autoplan.partition(f"hf:{directory}", plan, device="cpu", seed=7)
        load_weights(pm, directory)
        if pm.plan.zero == 1:
            pm.make_optimizer(torch.optim.AdamW)  # ZeRO-1 masters of other ranks: read as working copies
        values = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
                  for n, p in pm.named_parameters()}
        out[name] = values
    return out


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_every_parameter_holds_the_files_values_in_more_layouts(tmp_path):
    """bf16 ZeRO-1 at tp 2 x dp 2 (fp32 masters, of which each dp rank holds its share after
    make_optimizer: the others read as bf16 working copies), cp 2 x tp 2, and HSDP (zero 3, replicate
    2): every rank's parameters, put together, are the file's tensors (bf16 copies: rounded)."""
    from safetensors.torch import load_file

    directory = _save("llama", tmp_path / "llama", max_shard_size="40KB")
    plans = {
        "bf16-zero1-tp2": _plan(directory, tmp_path / "a.json", tp=2, pp=1, dp=2, zero=1, dtype="bf16"),
        "cp2-tp2": _plan(directory, tmp_path / "b.json", tp=2, pp=1, dp=2, cp=2),
        "hsdp": _plan(directory, tmp_path / "c.json", tp=1, pp=1, dp=4, zero=3, dp_replicate=2),
    }
    expected = {}
    for file in (tmp_path / "llama").glob("*.safetensors"):
        expected.update(load_file(file))
    results = run_ranks(_values_job, 4, directory, plans, timeout_s=360, pg_timeout_s=120)
    for name in plans:
        seen = set()
        for r in results.values():
            for n, value in r[name].items():
                rtol = 2**-8 if name.startswith("bf16") else 0  # a working copy: bf16's 8 significant bits
                torch.testing.assert_close(value, expected[n], rtol=rtol, atol=0, msg=lambda m, n=n, name=name: f"{name} {n}: {m}")
                seen.add(n)
        assert seen == set(expected), (name, seen ^ set(expected))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_cli_run_init_starts_from_the_files_weights(tmp_path):
    """The user's path: `autoplan suggest hf:DIR ... --pp 2 --out p.json`, then `autoplan run p.json --init DIR`:
    the first step's loss is transformers' own loss of the saved model on the same batch; weights of another
    model are refused in one line before any rank starts (exit 2)."""
    import json

    from autoplan.cli import main

    directory = _save("llama", tmp_path / "llama")
    plan = tmp_path / "p.json"
    assert main(["suggest", "--model", f"hf:{directory}", "--cluster", "1x2xcpu", "--global-batch", str(GLOBAL_BATCH),
                 "--seq-len", str(SEQ_LEN), "--pp", "2", "--dtype", "fp32", "--out", str(plan)]) == 0
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(plan), "--init", directory, "--steps", "1", "--metrics", str(metrics)]) == 0
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    one = autoplan.partition(f"hf:{directory}", autoplan.suggest(
        f"hf:{directory}", "1x1xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32", top=1)[0], device="cpu")
    template = one.output_template
    inputs, target = one.source.batch(0, 0, GLOBAL_BATCH, SEQ_LEN, template.shape, template.dtype)
    assert loss == pytest.approx(_transformers_loss(directory, inputs, target), rel=1e-6)

    other = _save("llama", tmp_path / "wide", vocab_size=512)
    assert main(["run", str(plan), "--init", other, "--steps", "1"]) == 2


def test_cli_export_checkpoint_format_hf(tmp_path):
    """`autoplan export-checkpoint CKPT --format hf --out DIR` writes a directory transformers loads with
    from_pretrained, with the checkpoint's logits exactly."""
    from transformers import AutoModelForCausalLM

    from autoplan.cli import main
    from autoplan.runtime.checkpoint import save_checkpoint

    directory = _save("llama", tmp_path / "llama")
    pm = _one_process_pm(directory, tmp_path)
    load_weights(pm, directory)
    save_checkpoint(tmp_path / "ckpt", 1, pm)
    assert main(["export-checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    a, b = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (tmp_path / "hf", directory))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)
