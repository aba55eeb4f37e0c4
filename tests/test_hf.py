"""Hugging Face models as a model source (`hf:` specs): built from configs, traced with torch.export
into layer blocks on the default bf16 path, planned, and materialized stage by stage by name."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import autoplan  # noqa: E402
from autoplan.graph.trace import extract_submodule, trace_model  # noqa: E402
from autoplan.runtime.parallel.split import tied_parameter_names  # noqa: E402
from autoplan.sources import SourceError, parse_source  # noqa: E402
from autoplan.sources.hf import DEFAULT_SEQ_LEN, HFSource  # noqa: E402

pytestmark = pytest.mark.hf

_DECODER = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,intermediate_size=128," \
           "vocab_size=256,max_position_embeddings=64"
SPECS = {
    "gpt2": "hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64",
    "llama": f"hf:llama:{_DECODER}",
    "mistral": f"hf:mistral:{_DECODER}",
    "qwen2": f"hf:qwen2:{_DECODER}",
    "bert": "hf:bert:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=256,"
            "max_position_embeddings=64",
    "vit": "hf:vit:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,image_size=32,"
           "patch_size=8",
    "t5": "hf:t5:num_layers=2,num_decoder_layers=2,d_model=64,d_kv=16,num_heads=4,d_ff=128,vocab_size=256",
    "mixtral": f"hf:mixtral:{_DECODER},num_local_experts=4,num_experts_per_tok=2",
}
FALCON = "hf:falcon:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=256"
# Layer blocks (encoder and decoder stacks for T5) and the blocks around them.
NUM_LAYERS = {"t5": 4}


def _seq_len(source: HFSource) -> dict:
    return {} if source.default_seq_len is None else {"seq_len": 32}


@pytest.mark.parametrize("name", list(SPECS))
def test_profile_and_suggest_through_the_api(name):
    spec = SPECS[name]
    source = parse_source(spec)
    assert parse_source(source.spec).spec == source.spec == spec
    prof = autoplan.profile(spec, **_seq_len(source))
    assert prof.tracer == "export"  # not the module-chain fallback
    names = [b.name for b in prof.blocks]
    layers = [n for n in names if n.rsplit(".", 1)[-1].isdigit()]
    assert len(layers) == NUM_LAYERS.get(name, 2), names
    assert names[0] == "embedding" and 2 <= len(names) - len(layers) <= 5, names
    assert prof.blocks[-1].kind == "head", names
    assert prof.dtype == "bfloat16"
    assert prof.num_layers == NUM_LAYERS.get(name, 2)
    assert all(b.fwd_flops > 0 for b in prof.blocks if b.name in layers)

    plans = autoplan.suggest(spec, "1x2xcpu", global_batch=4, pp=2, **_seq_len(source))
    assert plans and plans[0].pp == 2 and len(plans[0].stages) == 2 * plans[0].virtual_stages
    assert parse_source(plans[0].model).spec == spec


def test_moe_layer_counts_its_experts():
    """A Mixtral layer is a Llama layer of the same sizes whose MLP runs top-k (2) experts, plus the router."""
    layer = {name: autoplan.profile(SPECS[name], seq_len=16).blocks[1].fwd_flops for name in ("llama", "mixtral")}
    mlp = 3 * 2 * 16 * 64 * 128  # gate, up and down projections of 16 tokens (2 FLOPs per multiply-add)
    router = 2 * 16 * 64 * 4
    assert layer["mixtral"] - layer["llama"] == (2 - 1) * mlp + router


def test_inputs_follow_the_forward():
    t5 = parse_source(SPECS["t5"])
    ids, mask, decoder_ids = t5.example_inputs(2, 16)
    assert mask is None and ids.shape == decoder_ids.shape == (2, 16) and ids.dtype == torch.int64
    assert t5.default_seq_len == DEFAULT_SEQ_LEN and t5.max_seq_len is None
    (pixels,) = parse_source(SPECS["vit"]).example_inputs(3)
    assert pixels.shape == (3, 3, 32, 32) and pixels.dtype == torch.float32
    bert = parse_source(SPECS["bert"])
    (ids,) = bert.example_inputs(1, 8, device="cpu")
    assert int(ids.min()) >= 0 and int(ids.max()) < 256  # token_type_ids etc. are left to the model
    assert bert.default_seq_len == bert.max_seq_len == 64
    with pytest.raises(SourceError, match="exceeds"):
        bert.example_inputs(1, 65)
    assert parse_source(SPECS["llama"]).info == {"num_heads": 4, "num_kv_heads": 2, "hidden_size": 64,
                                                  "vocab_size": 256, "num_layers": 2}


@pytest.mark.parametrize("name", ["gpt2", "bert", "mixtral", "t5"])
def test_stages_materialize_to_the_full_models_values(name):
    """Each stage, materialized alone from meta, holds the values `build("cpu")` gives the whole
    model, parameters (tied heads included) and buffers transformers computes in __init__ alike."""
    source = parse_source(SPECS[name])
    full = source.build("cpu")
    values = {**dict(full.named_parameters(remove_duplicate=False)), **dict(full.named_buffers())}
    meta = source.build("meta")
    traced = trace_model(meta, source.example_inputs(1, 16))
    aliases = tied_parameter_names(meta)
    cut = traced.num_blocks // 2
    checked = 0
    for first, last in ((0, cut - 1), (cut, traced.num_blocks - 1)):
        stage, _, _ = extract_submodule(traced, first, last)
        stage.to_empty(device="cpu")
        source.init_weights(stage, seed=0, aliases=aliases)
        for key, tensor in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers()]:
            assert torch.equal(tensor, values[key]), key
            checked += 1
    assert checked >= len(values) - 2  # every value lands in some stage
    assert any("inv_freq" in k or "position_ids" in k for k in values) or name in ("gpt2", "t5")


def test_meta_build_materialized_equals_cpu_build_and_runs_in_bf16():
    source = parse_source(SPECS["llama"])
    ids = source.example_inputs(2, 16, device="cpu")
    reference = source.build("cpu")
    meta = source.build("meta")
    aliases = tied_parameter_names(meta)
    meta.to_empty(device="cpu")
    source.init_weights(meta, seed=0, aliases=aliases)
    with torch.no_grad():
        expected = reference(*ids).logits
        assert torch.equal(meta(*ids).logits, expected)
        # The exported graph follows the dtype it runs in ([Note: dtype-following graphs]).
        traced = trace_model(reference, ids)
        assert torch.equal(traced.gm(*ids).logits, expected)
        low = traced.gm.to(torch.bfloat16)(*ids).logits
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, atol=0.05, rtol=0.05)


def test_config_path_spec_round_trips_with_its_digest(tmp_path):
    source = parse_source(SPECS["llama"])
    config = source.config.to_dict()
    config["architectures"] = ["LlamaForSequenceClassification"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = parse_source(f"hf:{tmp_path}")
    assert parse_source(from_dir.spec).spec == from_dir.spec
    assert from_dir.file_digest() == parse_source(f"hf:{tmp_path / 'config.json'}").file_digest() is not None
    assert type(from_dir.build()).__name__ == "LlamaForSequenceClassification"
    assert source.file_digest() is None


@pytest.mark.parametrize("spec, match", [
    ("hf:llama:num_hidden_layer=2", "did you mean 'num_hidden_layers'"),
    ("hf:llama:num_hidden_layers=two", "not a valid int"),
    ("hf:llama:num_hidden_layers", "not key=value"),
    ("hf:lama:num_hidden_layers=2", "did you mean 'llama'"),
    ("hf:/no/such/dir", "does not exist"),
    ("hf:llama:hidden_size=64,num_attention_heads=5", "refuses .*not a multiple"),
    # Sizes transformers accepts whatever their sign (issue 29: num_hidden_layers=-1 planned "1 blocks").
    ("hf:llama:num_hidden_layers=-1", "num_hidden_layers=-1 must be at least 1.*set num_hidden_layers to 1 or more"),
    ("hf:llama:hidden_size=0", "hidden_size=0 must be at least 1"),
    ("hf:llama:num_attention_heads=-4", "num_attention_heads=-4 must be at least 1"),
    ("hf:llama:intermediate_size=0", "intermediate_size=0 must be at least 1"),
    ("hf:llama:vocab_size=1", "vocab_size=1 must be at least 2 .*nothing to predict"),
    ("hf:gpt2:n_layer=0", "n_layer=0 must be at least 1"),
    ("hf:t5:d_ff=-1", "d_ff=-1 must be at least 1"),
    ("hf:llama:num_hidden_layers=100000", "must be at most 1,024"),
])
def test_spec_errors_are_one_line(spec, match):
    with pytest.raises(SourceError, match=match) as info:
        parse_source(spec).build()
    assert "\n" not in str(info.value)


_SIZE_FIELDS = [("llama", f) for f in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                         "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim")] + \
               [("gpt2", f) for f in ("n_layer", "n_embd", "n_head", "n_positions", "n_inner")] + \
               [("t5", f) for f in ("num_layers", "num_decoder_layers", "d_model", "d_kv", "d_ff", "num_heads")] + \
               [("bart", f) for f in ("encoder_layers", "decoder_ffn_dim", "encoder_attention_heads")]


@pytest.mark.parametrize("value", [0, -3])
@pytest.mark.parametrize(("model_type", "field"), _SIZE_FIELDS)
def test_every_size_field_below_one_is_refused_by_name(model_type, field, value):
    """transformers takes any sign for these; a plan of a negative size is never what was meant."""
    with pytest.raises(SourceError) as info:
        parse_source(f"hf:{model_type}:{field}={value}")
    message = str(info.value)
    assert "\n" not in message and f"{field}={value} must be at least" in message, message


def test_a_config_file_with_a_negative_size_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                      "hidden_size": 64, "num_attention_heads": 4,
                                                      "intermediate_size": -128, "vocab_size": 256}))
    with pytest.raises(SourceError, match="intermediate_size=-128 must be at least 1") as info:
        parse_source(f"hf:{tmp_path}")
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


def _chunks(values: tuple, count: int) -> list[tuple]:
    split = [v.chunk(count) if isinstance(v, torch.Tensor) else [v] * count for v in values]
    return list(zip(*split))


def _pipelined_step(rank, world_size, cases):
    from autoplan.runtime import partition

    torch.manual_seed(1234 + rank)  # must not matter: every rank builds the same weights by name
    out = []
    for spec, plan in cases:
        source = parse_source(spec)
        pm = partition(spec, plan, device="cpu")
        inputs, target = source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, (1, plan.job.seq_len, 256), torch.float32)
        loss = pm.step(*inputs, target=target)
        out.append({"loss": None if loss is None else float(loss),
                    "grads": {n: p.grad.clone() for n, p in pm.named_parameters()}})
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_ranks_match_a_single_process_build():
    """A plan of an hf: spec, run on 2 gloo ranks that each build and materialize only their stage,
    gives the loss and every gradient of `build("cpu")` run on one process."""
    from tests._dist import run_ranks

    specs = [SPECS["llama"], SPECS["t5"] + ",dropout_rate=0.0",
             SPECS["gpt2"] + ",resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",  # gpt2: a tied head
             FALCON]  # falcon: tensors export lifts from the forward's literals, held by the stages
    cases = [(spec, autoplan.suggest(spec, "1x2xcpu", global_batch=4, seq_len=16, pp=2, dtype="fp32",
                                     schedule="1f1b", micro_batch_size=1)[0]) for spec in specs]
    # bf16 (the default): the graph traced in fp32 computes in bf16 ([Note: dtype-following graphs]).
    cases.append((specs[0], autoplan.suggest(specs[0], "1x2xcpu", global_batch=4, seq_len=16, pp=2,
                                             schedule="zb-h1", micro_batch_size=1)[0]))
    results = run_ranks(_pipelined_step, 2, cases, timeout_s=110)
    for i, (spec, plan) in enumerate(cases):
        exact = plan.job.dtype == "float32"
        source = parse_source(spec)
        model = source.build("cpu")
        inputs, target = source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, (1, plan.job.seq_len, 256), torch.float32)
        chunks = plan.num_microbatches
        expected = 0.0
        for mb_inputs, mb_target in zip(_chunks(inputs, chunks), target.chunk(chunks)):
            loss = source.loss_fn(model(*mb_inputs), mb_target) / chunks
            loss.backward()
            expected += loss.item()
        reference = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        losses = [r[i]["loss"] for r in results.values() if r[i]["loss"] is not None]
        assert losses == [pytest.approx(expected, rel=1e-5 if exact else 1e-2)], spec
        seen = set()
        for rank_results in results.values():
            for name, grad in rank_results[i]["grads"].items():
                assert grad.dtype == torch.float32  # the fp32 masters' gradients under bf16
                tolerance = {"rtol": 1e-5, "atol": 1e-6} if exact else {"rtol": 0.1, "atol": 2e-3}
                torch.testing.assert_close(grad, reference[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")
                seen.add(name)
        assert {n for n, _ in model.named_parameters()} <= seen


def test_export_at_the_compute_dtype_keeps_the_models_own_casts():
    """Traced on meta for bf16 (`trace_export(dtype=)`), then materialized by name and run in bf16, the
    graph computes exactly what transformers' own bf16 model does (fp32 rotary tables and norm
    statistics included): Mixtral's router and experts too."""
    import copy

    from autoplan.graph.export_trace import trace_export
    from autoplan.graph.trace import retarget_device

    for name in ("llama", "mixtral"):
        source = parse_source(SPECS[name])
        ids = source.example_inputs(2, 16, device="cpu")
        native = copy.deepcopy(source.build("cpu")).to(torch.bfloat16)
        meta = source.build("meta")
        aliases = tied_parameter_names(meta)
        gm = trace_export(meta, source.example_inputs(2, 16), torch.bfloat16)
        retarget_device(gm, "cpu")
        assert any(torch.float32 in (*n.args, *n.kwargs.values()) for n in gm.graph.nodes)  # the upcasts stay
        gm.to_empty(device="cpu")
        source.init_weights(gm, seed=0, aliases=aliases)
        with torch.no_grad():
            assert torch.equal(gm.to(torch.bfloat16)(*ids).logits, native(*ids).logits), name
