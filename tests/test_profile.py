"""Profiling: fake-tensor numbers agree with an eager CPU run, and with published formulas."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan import models as zoo
from autoplan.graph import profile as profile_mod
from autoplan.graph import timing
from autoplan.graph.block_cost import flop_counter
from autoplan.graph.blocks import ModelProfile
from autoplan.graph.fake_run import ProfileError
from autoplan.graph.profile import profile_model
from autoplan.graph.trace import trace_model

GPT_SMALL = "gpt:num_layers=3,hidden_size=64,num_heads=4,vocab_size=128,max_seq_len=64"
LLAMA_SMALL = "llama:num_layers=3,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=128,max_seq_len=64"


def _eager_reference(model, inputs, traced, loss_fn=None, target=None):
    """Per-block FLOPs (FlopCounterMode's per-module counts) and saved bytes (saved_tensors_hooks,
    attributed by module pre-hooks) from a real forward and backward on the CPU."""
    current = [0]
    saved: dict[int, dict[int, int]] = defaultdict(dict)
    # Parameters and buffers (e.g. RoPE tables) are model state, not activations.
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    handles = []
    names = dict(model.named_modules())
    for i, paths in enumerate(traced.block_modules):
        # export adds modules of its own (e.g. `_guards_fn`); hook the first one the model has
        module = names[next(p for p in paths if p in names)]
        handles.append(module.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i)))

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[current[0]][storage.data_ptr()] = storage.nbytes()
        return t

    with flop_counter() as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
            if loss_fn is not None:
                out = loss_fn(out, target)
        out = out if out.dim() == 0 else out.float().sum()
        out.backward()
    for h in handles:
        h.remove()
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    return per_module, {i: sum(v.values()) for i, v in saved.items()}


@pytest.mark.parametrize("spec", [GPT_SMALL, LLAMA_SMALL])
def test_fake_profile_equals_eager_cpu(spec):
    batch, seq = 2, 32
    result = autoplan.profile_with_graph(spec, batch_size=batch, seq_len=seq, dtype="fp32")
    model = zoo.build_model(spec, device="cpu")
    inputs = zoo.example_inputs(spec, batch, seq, device="cpu")
    target = zoo.example_targets(spec, batch, seq, device="cpu")
    flops, saved = _eager_reference(model, inputs, result.traced, zoo.lm_loss, target)
    root = type(model).__name__
    for i, block in enumerate(result.profile.blocks):
        if block.kind == "layer":
            assert block.flops == flops[f"{root}.{block.name}"], block.name
        assert block.saved_bytes == pytest.approx(saved.get(i, 0), rel=0.01), block.name
    assert result.profile.flops == flops["Global"]


def _eager_block_saved_bytes(traced, inputs):
    """Saved bytes per block when the traced graph's blocks run on real CPU tensors."""
    from autoplan.graph.trace import extract_submodule

    env = dict(zip(traced.input_names, inputs, strict=True))
    state = {p.untyped_storage().data_ptr() for p in [*traced.gm.parameters(), *traced.gm.buffers()]}
    result = {}
    for i in range(traced.num_blocks):
        sub, names, outputs = extract_submodule(traced, i, i)
        saved = {}

        def pack(t, saved=saved):
            if t.untyped_storage().data_ptr() not in state:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        args = [env[n].detach().requires_grad_(env[n].is_floating_point()) for n in names]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            env.update(zip(outputs, sub(*args), strict=True))
        result[i] = sum(saved.values())
    return result


@pytest.mark.hf
def test_fake_profile_equals_eager_cpu_transformers_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, use_cache=False,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(config)
    prof, traced = profile_model(meta_model, (ids.to("meta"),), dtype=torch.float32)
    assert traced.tracer == "export"
    flops, hf_saved = _eager_reference(model, (ids,), traced, lambda out, _: out.logits.sum(), None)
    real_traced = trace_model(model, (ids,), tracer="export")
    graph_saved = _eager_block_saved_bytes(real_traced, (ids,))
    for i, block in enumerate(prof.blocks):
        if block.kind == "layer":
            assert block.flops == flops[f"LlamaForCausalLM.{block.name}"], block.name
            assert block.saved_bytes == pytest.approx(graph_saved[i], rel=0.01), block.name
            # Under torch.export transformers repeats K/V for grouped-query attention (expand +
            # reshape copies) where eager passes enable_gqa to SDPA, so the exported graph, which
            # is what autoplan runs, saves somewhat more than HF eager does.
            assert hf_saved[i] <= block.saved_bytes <= 1.3 * hf_saved[i], block.name


def test_gpt_layer_flops_match_megatron_formula():
    b, s, h = 1, 1024, 1024
    prof = autoplan.profile(f"gpt:num_layers=2,hidden_size={h},num_heads=16,vocab_size=1024,max_seq_len={s}",
                            batch_size=b, seq_len=s)
    # Narayanan et al. 2021 (SC'21), appendix: forward FLOPs of one layer = 24bsh^2 + 4bs^2h.
    expected = 24 * b * s * h * h + 4 * b * s * s * h
    layer = next(blk for blk in prof.blocks if blk.kind == "layer")
    assert layer.fwd_flops == pytest.approx(expected, rel=0.02)
    # Backward: twice the matmuls, and flash attention's backward recomputes the scores, so its core
    # costs 5 batched matmuls to forward's 2 (Dao et al. 2022, Alg. 4): 48bsh^2 + 10bs^2h.
    assert layer.bwd_flops == pytest.approx(48 * b * s * h * h + 10 * b * s * s * h, rel=0.02)


def test_profile_params_match_megatron_formula():
    layers, h, v, s = 4, 256, 1024, 128
    prof = autoplan.profile(f"gpt:num_layers={layers},hidden_size={h},num_heads=8,vocab_size={v},max_seq_len={s}",
                            batch_size=1, seq_len=s)
    # Narayanan et al. 2021, Eq. 2 (tied head), plus the final LayerNorm's 2h.
    assert prof.num_params == pytest.approx(
        12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h)) + 2 * h, rel=1e-12)
    head = prof.blocks[-1]
    assert head.kind == "head" and head.num_params == 0 and head.param_bytes == v * h * 2  # tied: holds a copy


def test_identical_layers_are_profiled_once(monkeypatch):
    calls = []
    original = profile_mod.measure_block
    monkeypatch.setattr(profile_mod, "measure_block", lambda *a, **k: calls.append(1) or original(*a, **k))
    prof = autoplan.profile("llama3-8b:num_layers=6", batch_size=1, seq_len=128)
    layers = [b for b in prof.blocks if b.kind == "layer"]
    assert len(layers) == 6 and len({b.fingerprint for b in layers}) == 1
    # Each distinct block is measured at the batch and at twice it (graph/operators.py, merge_batches):
    # 6 layers measured once.
    assert len(calls) == 2 * (len(prof.blocks) - 5)


def test_profile_json_round_trip():
    prof = autoplan.profile(GPT_SMALL, batch_size=1, seq_len=16)
    again = ModelProfile.from_dict(json.loads(prof.to_json()))
    assert again == prof


def test_timed_profile_is_cached(monkeypatch, tmp_path):
    prof = autoplan.profile(GPT_SMALL, batch_size=1, seq_len=16, device="cpu", dtype="fp32", cache_dir=tmp_path)
    assert prof.is_timed and all(b.fwd_time_s > 0 for b in prof.blocks if b.kind == "layer")
    assert len(list(tmp_path.glob("*.json"))) == 1

    def must_not_time(*_a, **_k):
        raise AssertionError("the cached profile should have been reused")

    monkeypatch.setattr(profile_mod, "time_block", must_not_time)
    again = autoplan.profile(GPT_SMALL, batch_size=1, seq_len=16, device="cpu", dtype="fp32", cache_dir=tmp_path)
    assert again.blocks == prof.blocks


def test_tied_head_names_the_block_it_shares_with():
    gpt = autoplan.profile(GPT_SMALL, batch_size=1, seq_len=16)
    head = gpt.blocks[-1]
    assert head.tied_to_block == 0 and head.tied_params == 128 * 64  # the embedding's vocab x hidden table
    assert all(b.tied_params == 0 and b.tied_to_block is None for b in gpt.blocks[:-1])
    untied = autoplan.profile(GPT_SMALL + ",tie_embeddings=False", batch_size=1, seq_len=16)
    assert all(b.tied_params == 0 for b in untied.blocks)


def test_repeated_blocks_are_timed_as_a_chain_of_copies():
    mib = 2**20
    assert timing.chain_length(3 * mib, occurrences=300, cache_bytes=32 * mib) == 22  # ceil(64 / 3)
    assert timing.chain_length(3 * mib, occurrences=8, cache_bytes=32 * mib) == 8  # all fit: warm, as run
    assert timing.chain_length(262 * mib, occurrences=1, cache_bytes=32 * mib) == 1
    assert timing.chain_length(0, occurrences=10_000, cache_bytes=32 * mib) == timing._MAX_CHAIN
    assert timing.last_level_cache_bytes("cpu") >= 2**20


def test_timed_profile_fits_a_fixed_part_from_two_batch_sizes(monkeypatch, tmp_path):
    calls = []
    original = profile_mod.time_block

    def record(traced, index, inputs, *args):
        # args: device, dtype, warmup, repeats, occurrences (then the spreads list, at the first batch)
        calls.append((index, inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) else None, args[4]))
        return original(traced, index, inputs, *args)

    monkeypatch.setattr(profile_mod, "time_block", record)
    prof = autoplan.profile(GPT_SMALL, batch_size=2, seq_len=16, device="cpu", dtype="fp32", cache_dir=tmp_path)
    assert prof.extra["batch_scaling"] == "affine"
    unique = len({b.fingerprint for b in prof.blocks})
    assert len(calls) == 2 * unique  # each distinct block at batch 2 and at batch 4
    assert sorted({c[1] for c in calls if c[0] == 0}) == [2, 4]
    layer_calls = [c for c in calls if prof.blocks[c[0]].kind == "layer"]
    assert {c[2] for c in layer_calls} == {3}  # three identical layers: timed as a run of three copies
    for b in prof.blocks:
        assert 0.0 <= b.fwd_time_fixed_s <= b.fwd_time_s and 0.0 <= b.bwd_time_fixed_s <= b.bwd_time_s


def test_inputs_the_model_rejects_are_one_line_errors():
    model = zoo.build_model(GPT_SMALL)
    with pytest.raises(ProfileError, match="rejects the example inputs"):
        profile_model(model, (torch.zeros(2, 3, 4, device="meta"),))


def test_deferred_code_block_runs_like_an_eager_one():
    """Profiling extracts blocks with their code generated on first call; they behave the same."""
    from autoplan.graph.trace import extract_submodule

    spec = "gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
    model = zoo.build_model(zoo.parse_model_spec(spec), device="cpu")
    ids = torch.randint(0, 64, (2, 16))
    traced = trace_model(model, (ids,))
    eager, inputs, outputs = extract_submodule(traced, 0, 1)
    deferred, inputs2, outputs2 = extract_submodule(traced, 0, 1, defer_code=True)
    assert (inputs, outputs) == (inputs2, outputs2)
    assert [n.format_node() for n in deferred.graph.nodes] == [n.format_node() for n in eager.graph.nodes]
    assert dict(deferred.named_parameters()).keys() == dict(eager.named_parameters()).keys()
    torch.testing.assert_close(deferred(ids), eager(ids))
    assert deferred.code == eager.code


def test_cpu_without_half_precision_instructions_times_in_fp32(monkeypatch):
    from autoplan.graph.timing import timing_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    dtype, note = timing_dtype("cpu", torch.bfloat16)
    assert dtype == torch.float32 and "timed in fp32" in note and "bfloat16" in note
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert timing_dtype("cpu", torch.bfloat16) == (torch.bfloat16, None)
    assert timing_dtype("cpu", torch.float32) == (torch.float32, None)
    assert timing_dtype("meta", torch.bfloat16) == (torch.bfloat16, None)


_COND_FILE = Path(__file__).parent / "user_models" / "cond_branches.py"


@pytest.mark.parametrize(("builder", "code"), [
    ("build", "return torch.cond(y.sum() > 0"),  # in each layer: a leaf module the profile runs
    ("build_top", "x = torch.cond(x.sum() > 0"),  # in the top-level forward: export traces it into the graph
])
def test_cli_torch_cond_is_one_line_naming_its_line_and_the_rewrite(capsys, tmp_path, monkeypatch, builder, code):
    """A model using torch.cond was a NotImplementedError traceback from the operator recorder
    (graph/operators.py, [Note: higher-order operators])."""
    from autoplan.cli import main

    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    line = next(i for i, text in enumerate(_COND_FILE.read_text().splitlines(), 1) if code in text)
    rc = main(["suggest", "--model", f"{_COND_FILE}:{builder}", "--cluster", "1x2xcpu", "--global-batch", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("autoplan: error: the model calls torch.cond at "), err
    assert f"cond_branches.py:{line} in forward" in err and "torch.where(pred, a, b)" in err, err
    assert "Traceback" not in err and "NotImplementedError" not in err
