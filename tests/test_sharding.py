"""Tensor-parallel layouts found from the data flow (graph/sharding.py), the search reading them,
and numerics at tp = 2 for models outside the zoo (one 2-rank gloo spawn for all of them).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from _dist import make_plan, run_ranks
from torch import nn

from autoplan import models as zoo
from autoplan.graph.sharding import find_layout

GPT = "gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
LLAMA = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"
SEQ = 16
IDS = (torch.zeros(1, 8, dtype=torch.long),)

transformers = pytest.importorskip("transformers")


def _custom_model(seed=0):
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_model.py"
    spec = importlib.util.spec_from_file_location("autoplan_example_custom_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return module.TinyTransformer(vocab=64, width=32, depth=2, heads=4)


def _hf(name: str, seed=0, device="cpu"):
    t = transformers
    torch.manual_seed(seed)
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        if name == "llama":
            return t.LlamaForCausalLM(t.LlamaConfig(
                vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False))
        if name == "gpt2":
            return t.GPT2LMHeadModel(t.GPT2Config(
                vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, use_cache=False, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        if name == "bert":
            return t.BertForMaskedLM(t.BertConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        if name == "t5":
            return t.T5ForConditionalGeneration(t.T5Config(
                vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False))
    raise ValueError(name)


class ConvNet(nn.Module):
    """ResNet-like: convolutions with a residual, pooled into one linear classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                    for _ in range(2))
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = x + block(x)
        return self.fc(x.mean((2, 3)))


# ---- layouts -----------------------------------------------------------------------------------


def test_zoo_layouts_are_megatrons():
    gpt = find_layout(zoo.build_model(GPT, device="meta"))
    assert dict(gpt) == {
        **{f"layers.{i}.{k}": v for i in range(2) for k, v in
           {"attention.qkv": "colwise", "attention.proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}.items()},
        "tok_embeddings": "vocab-embedding", "output": "vocab-head"}
    assert gpt.layers == ("layers.0", "layers.1") and gpt.degrees(8) == [1, 2, 4]  # 4 heads
    llama = find_layout(zoo.build_model(LLAMA, device="meta"), zoo.example_inputs(LLAMA, 2, SEQ, device="meta"))
    assert {k: v for k, v in llama.items() if k.startswith("layers.1.")} == {
        "layers.1.attention.wq": "colwise", "layers.1.attention.wk": "colwise", "layers.1.attention.wv": "colwise",
        "layers.1.attention.wo": "rowwise", "layers.1.mlp.w1": "colwise", "layers.1.mlp.w3": "colwise",
        "layers.1.mlp.w2": "rowwise"}
    assert llama.divides["num_kv_heads"][0] == 2 and llama.degrees(8) == [1, 2]


@pytest.mark.parametrize("name, counts, replicated", [
    ("llama", {"num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64, "vocab_size": 64}, 0),
    ("bert", {"num_heads": 4, "ffn_hidden_size": 64, "vocab_size": 64}, 0),
    ("gpt2", {"num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 64}, 0),  # c_attn: [q | k | v], by thirds
    ("t5", {"num_heads": 4, "ffn_hidden_size": 64, "vocab_size": 64}, 0),
])
def test_transformers_layouts(name, counts, replicated):
    model = _hf(name, device="meta")
    inputs = {"input_ids": IDS[0], "decoder_input_ids": IDS[0]} if name == "t5" else IDS
    layout = find_layout(model, inputs)
    assert {k: c for k, (c, _) in layout.divides.items()} == counts
    assert len(layout.replicated) == replicated and not layout.note
    assert "colwise" in layout.values() and "rowwise" in layout.values()
    assert list(layout.values()).count("vocab-embedding") == 1
    if name == "gpt2":  # Conv1D, weights (in, out)
        assert layout["transformer.h.0.mlp.c_fc"] == "colwise" and layout["transformer.h.0.attn.c_attn"] == "colwise-qkv"
        assert "transformer.h.0.attn.c_proj" in layout.transposed


def test_custom_model_shards_the_mlp_and_replicates_multihead_attention():
    layout = find_layout(_custom_model().to("meta"))
    assert dict(layout) == {"blocks.0.mlp.0": "colwise", "blocks.0.mlp.2": "rowwise", "blocks.1.mlp.0": "colwise",
                            "blocks.1.mlp.2": "rowwise", "embed": "vocab-embedding", "head": "vocab-head"}
    assert set(layout.replicated) == {"blocks.0.attn", "blocks.1.attn"} and layout.layers == ()
    assert 0 < layout.sharded_params < layout.total_params


def test_conv_net_has_no_layout_and_says_why():
    layout = find_layout(ConvNet(), (torch.randn(1, 3, 8, 8),))
    assert not layout and layout.degrees(8) == [1]
    assert "no column- and row-parallel pair" in layout.refusal(2) and "\n" not in layout.refusal(2)


def test_a_refusal_names_the_count_tp_does_not_divide():
    layout = find_layout(_hf("llama", device="meta"), IDS)
    assert layout.refusal(2) is None
    assert layout.refusal(4) == ("tp = 4 does not divide num_kv_heads = 2 of 'model.layers.0.self_attn'; "
                                 "plan with a tp that divides it")


# ---- the search --------------------------------------------------------------------------------


def test_search_proposes_tp_only_where_the_layout_allows():
    import autoplan
    from autoplan.api import suggest_with_stats
    from autoplan.search.space import PlanningError

    conv, _ = suggest_with_stats(ConvNet(), "1x4xcpu", global_batch=8, example_inputs=(torch.randn(1, 3, 8, 8),))
    assert conv.plans and {p.tp for p in conv.plans} == {1} and not any(p.sequence_parallel for p in conv.plans)
    assert conv.notes[0] == ("tp 2, 4 not considered: the model has no tensor-parallel layout: none of its 1 linear "
                             "layers feeds another through element-wise or attention ops only (no column- and "
                             "row-parallel pair)")
    assert any(n.startswith("cpu priced with: ") for n in conv.notes)  # the calibration, and where its numbers come from
    with pytest.raises(PlanningError, match="no tensor-parallel layout") as info:
        autoplan.suggest(ConvNet(), "1x4xcpu", global_batch=8, example_inputs=(torch.randn(1, 3, 8, 8),), tp=2)
    assert "\n" not in str(info.value)
    llama, _ = suggest_with_stats(_hf("llama", device="meta"), "1x8xcpu", global_batch=8, seq_len=SEQ,
                                  example_inputs=(torch.zeros(1, SEQ, dtype=torch.long),), top=20)
    assert {p.tp for p in llama.plans} <= {1, 2}  # 2 KV heads
    assert not any(p.sequence_parallel for p in llama.plans)  # an inlined graph: no sequence parallelism
    assert llama.notes[0] == "tp 4, 8 not considered: tp 4 does not divide the model's 2 key/value heads"
    with pytest.raises(PlanningError, match="--tp 4 does not divide the model's 2 key/value heads"):
        autoplan.suggest(_hf("llama", device="meta"), "1x8xcpu", global_batch=8, seq_len=SEQ,
                         example_inputs=(torch.zeros(1, SEQ, dtype=torch.long),), tp=4)
    with pytest.raises(PlanningError, match="--sequence-parallel needs transformer layers"):
        autoplan.suggest(_hf("llama", device="meta"), "1x8xcpu", global_batch=8, seq_len=SEQ,
                         example_inputs=(torch.zeros(1, SEQ, dtype=torch.long),), tp=2, sequence_parallel=True)


# ---- numerics at tp = 2 ------------------------------------------------------------------------


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def lm_loss(out, target):
    return F.cross_entropy(_logits(out).flatten(0, 1).float(), target.flatten())


def _build(name):
    return _custom_model() if name == "custom" else _hf(name)


def _data(batch, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, SEQ), generator=gen), torch.randint(0, 64, (batch, SEQ), generator=gen)


def _make_plan(name, *, tp=2, pp=1, dp=1, recompute="none"):
    from autoplan.graph.profile import model_fingerprint
    from autoplan.graph.trace import trace_model

    model = _build(name)
    traced = trace_model(model, (_data(2)[0],))
    return make_plan(name, model_fingerprint(model), traced.block_names, pp=pp, dp=dp, tp=tp, recompute=recompute)


def _reference(name, plan):
    model = _build(name)
    ids, tgt = _data(plan.job.global_batch)
    chunks = plan.dp * plan.num_microbatches
    total = 0.0
    for a, b in zip(ids.chunk(chunks), tgt.chunk(chunks)):
        loss = lm_loss(model(a), b) / chunks
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _tp_cases(rank, world_size, cases):
    from torch.distributed.tensor import DTensor

    from autoplan.runtime import partition

    out = []
    for name, plan in cases:
        ids, tgt = _data(plan.job.global_batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = partition(_build(name), plan, example_inputs=(ids[:2],), loss_fn=lm_loss, example_target=tgt[:2],
                           device="cpu")
        loss = pm.step(ids, target=tgt)
        params = list(pm.named_parameters())
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in params if p.grad is not None}
        sharded = {n: id(p) for stage in pm.stages.values() for n, p in stage.module.named_parameters(remove_duplicate=False)
                   if isinstance(p, DTensor) and not p.placements[0].is_replicate()}
        pm.make_optimizer(torch.optim.AdamW, lr=1e-3, fused=True).step()  # the launcher's optimizer
        out.append({"loss": None if loss is None else float(loss), "grads": grads, "sharded": sharded})
    return out


def _check(cases, results):
    for i, (name, plan) in enumerate(cases):
        ref_loss, ref_grads = _reference(name, plan)
        seen = {n for r in results.values() for n in r[i]["grads"]}
        assert set(ref_grads) <= seen, f"{name}: no rank has {sorted(set(ref_grads) - seen)[:3]}"
        layout = find_layout(_build(name), (_data(2)[0],))
        losses = [r[i]["loss"] for r in results.values() if r[i]["loss"] is not None]
        assert len(losses) == plan.dp * plan.tp and all(loss == pytest.approx(ref_loss, rel=1e-4) for loss in losses)
        for rank, rank_results in results.items():
            res = rank_results[i]
            for n, grad in ref_grads.items():
                if n not in res["grads"]:
                    continue  # on another pipeline stage
                torch.testing.assert_close(res["grads"][n], grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, n=n, r=rank, c=name: f"{c} rank {r} {n}: {m}")
            # Every module of the layout holds sharded parameters, and nothing else does (but a tied alias).
            owners = {n.rpartition(".")[0] for n in res["sharded"]}
            if plan.pp == 1:
                assert set(layout) <= owners, f"{name}: {sorted(set(layout) - owners)}"
            of_layout = {i for n, i in res["sharded"].items() if n.rpartition(".")[0] in layout}
            assert set(res["sharded"].values()) == of_layout, name


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_tp2_matches_a_single_process_reference():
    cases = [(name, _make_plan(name)) for name in ("custom", "llama", "bert", "gpt2")]
    cases.append(("llama", _make_plan("llama", recompute="full")))
    _check(cases, run_ranks(_tp_cases, 2, cases, timeout_s=140))


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_tp2_with_pipeline_and_data_parallelism_matches_the_reference():
    cases = [("llama", _make_plan("llama", pp=2)), ("gpt2", _make_plan("gpt2", pp=2)),
             ("bert", _make_plan("bert", dp=2)), ("custom", _make_plan("custom", dp=2))]
    _check(cases, run_ranks(_tp_cases, 4, cases, timeout_s=140))


@pytest.mark.parametrize("spec", ["gpt3-175b:num_layers=6", "llama3-8b:num_layers=5", "gpt2-small"])
def test_replayed_layers_give_the_layout_a_full_run_gives(spec, monkeypatch, tmp_path):
    """[Note: repeated layers] in graph/data_flow.py: the third and later identical layers are not run
    through the data flow; the layout is the one a run through every layer finds."""
    import torch

    import autoplan.graph.data_flow as data_flow
    import autoplan.graph.profile as profile_mod
    import autoplan.graph.sharding as sharding_mod
    from autoplan.api import profile_with_graph

    captured = {}
    original = profile_mod.tensor_parallel_summary

    def capture(traced, inputs):
        captured["args"] = (traced, inputs)
        return original(traced, inputs)

    monkeypatch.setattr(profile_mod, "tensor_parallel_summary", capture)
    profile_with_graph(spec, seq_len=64, cache_dir=tmp_path)
    replayed = sharding_mod.traced_layout(*captured["args"])
    monkeypatch.setattr(data_flow.FlowInterpreter, "call_module", torch.fx.Interpreter.call_module)
    full = sharding_mod.traced_layout(*captured["args"])
    assert replayed.styles and replayed.styles == full.styles
    assert replayed.groups == full.groups and replayed.layers == full.layers and replayed.divides == full.divides
