"""Context parallelism beyond the zoo's llama: transformers causal LMs (position ids and their
attention interface, sources/hf_context.py), a model file whose forward takes `position_ids`, and the
zoo's mixture of experts (its load-balancing loss counted over the whole sequence). Plans from `autoplan suggest --cp 2 ... --out p.json`, run by
`autoplan.partition(spec, "p.json").step` on 4 gloo ranks (and one through `autoplan run`),
against a single-process reference of the whole model: loss and every gradient."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli import run_main
from _dist import run_ranks
from _rank_compare import assert_ranks_match_reference
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH, _full, _reference

import autoplan

ROOT = Path(__file__).resolve().parent.parent
_HF = "num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,intermediate_size=64," \
      "vocab_size=128,max_position_embeddings=64"
MODELS = {
    "hf-llama": f"hf:llama:{_HF}",
    "hf-qwen2": f"hf:qwen2:{_HF}",
    "hf-mistral": f"hf:mistral:{_HF}",  # its 4096-token window never bites within 64 positions
    "sdpa-file": f"{ROOT / 'tests/user_models/sdpa_positions.py'}:build",
    # The zoo's mixture of experts with a capacity that drops nothing (num_experts / experts_per_token),
    # its load-balancing loss on, and a shared expert.
    "zoo-moe": "moe:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=48,vocab_size=128,"
               "max_seq_len=64,num_experts=4,experts_per_token=2,num_shared_experts=1,capacity_factor=2",
    # transformers' mixtures of experts (routed, dropless; no load-balancing loss by default):
    # sources/hf.py `routes_tokens_alone`.
    "hf-mixtral": f"hf:mixtral:{_HF},num_local_experts=4,num_experts_per_tok=2",
    "hf-qwen2-moe": f"hf:qwen2_moe:{_HF},moe_intermediate_size=32,shared_expert_intermediate_size=64,num_experts=4,"
                    "num_experts_per_tok=2",
}
MOE_MODELS = ("zoo-moe", "hf-mixtral", "hf-qwen2-moe")
LAYOUTS = {"cp2": ["--tp", "1", "--cp", "2", "--dp", "4", "--pp", "1"],
           "cp2-pp2": ["--tp", "1", "--cp", "2", "--dp", "2", "--pp", "2"],
           "cp2-tp2": ["--tp", "2", "--cp", "2", "--dp", "2", "--pp", "1"]}  # tp over an inlined (export) graph
SEQ_LEN = 32


def _suggest(spec: str, layout: str, out: Path) -> Path:
    result = run_main("suggest", "--model", spec, "--cluster", "1x4xcpu", "--global-batch", str(GLOBAL_BATCH),
                      "--seq-len", str(SEQ_LEN), "--micro-batch-size", str(MICRO_BATCH), "--dtype", "fp32",
                      *LAYOUTS[layout], *(["--ep", "1"] if spec in {MODELS[m] for m in MOE_MODELS} else []),
                      "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["cp"] == 2
    return out


def _rank_job(rank: int, world_size: int, cases: dict) -> dict:
    out = {}
    for name, (spec, path) in cases.items():
        pm = autoplan.partition(spec, path, device="cpu")
        plan, template = pm.plan, pm.output_template
        inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
        loss = pm.step(*inputs, target=target)
        grads = {n: _full(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
        out[name] = dict(loss=None if loss is None else float(loss),
                         grads={} if pm.layout.dp_index or pm.layout.tp_index else grads,
                         batch=(inputs, target) if rank == 0 else None)
    return out


def _check(cases: dict, tmp_path: Path) -> None:
    """`cases`: name -> (model, layout); each planned by the CLI, run on 4 ranks, checked."""
    planned = {name: (MODELS[model], str(_suggest(MODELS[model], layout, tmp_path / f"{name}.json")))
               for name, (model, layout) in cases.items()}
    results = run_ranks(_rank_job, 4, planned, timeout_s=500, pg_timeout_s=120)
    for name, (spec, path) in planned.items():
        plan = autoplan.Plan.load(path)
        inputs, target = results[0][name]["batch"]
        assert spec.startswith("moe") or any(isinstance(x, torch.Tensor) and x.shape == (GLOBAL_BATCH, SEQ_LEN) and
                   torch.equal(x[0], torch.arange(SEQ_LEN)) for x in inputs), f"{name}: no position ids fed"  # the zoo reads them
        model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
        assert_ranks_match_reference(name, results, model, ref_loss, ref_grads, rtol=1e-4 if plan.tp > 1 else 1e-5)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_transformers_llama_a_model_file_and_the_zoo_moe_at_cp2_match_a_single_process(tmp_path):
    _check({"hf-llama-cp2-pp2": ("hf-llama", "cp2-pp2"), "sdpa-file-cp2": ("sdpa-file", "cp2"),
            "zoo-moe-cp2": ("zoo-moe", "cp2"), "hf-mixtral-cp2": ("hf-mixtral", "cp2")}, tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_transformers_models_at_cp2_and_cp2_pp2_match_a_single_process(tmp_path):
    cases = {f"{model}-{layout}": (model, layout) for model in ("hf-llama", "hf-qwen2", "hf-mistral")
             for layout in ("cp2", "cp2-pp2") if (model, layout) != ("hf-llama", "cp2-pp2")}
    cases["hf-llama-cp2-tp2"] = ("hf-llama", "cp2-tp2")
    cases.update({"hf-mixtral-cp2-pp2": ("hf-mixtral", "cp2-pp2"), "hf-qwen2-moe-cp2": ("hf-qwen2-moe", "cp2"),
                  "hf-qwen2-moe-cp2-pp2": ("hf-qwen2-moe", "cp2-pp2")})
    _check(cases, tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_transformers_llama_at_cp2_through_autoplan_run(tmp_path):
    path = _suggest(MODELS["hf-llama"], "cp2-pp2", tmp_path / "p.json")
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(path), "--steps", "2"], capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-2000:]


def test_the_model_source_says_whether_it_offers_cp():
    """The source tells the model its positions (a `position_ids` input it feeds), or says why not."""
    from autoplan.sources import parse_source

    for spec in (MODELS["hf-llama"], MODELS["sdpa-file"]):
        source = parse_source(spec)
        assert source.context_parallel_refusal(source.build("meta")) is None, spec
        assert any(t.positions for t in source.input_templates()), spec
    for spec in (f"hf:gemma2:{_HF},head_dim=8", f"hf:mistral:{_HF},sliding_window=16"):
        source = parse_source(spec)  # autoplan's attention operator (models/windowed_attention.py)
        assert source.context_parallel_refusal(source.build("meta")) is None, spec


def test_the_cp_attention_of_a_transformers_model_is_its_own():
    """The attention a model offering cp is built with (no mask, `is_causal`) computes what
    transformers' own SDPA attention does."""
    import transformers

    from autoplan.sources import parse_source

    source = parse_source(MODELS["hf-llama"])
    model = source.build("cpu")
    config = source.config
    config._attn_implementation = "sdpa"
    own = transformers.LlamaForCausalLM(config)
    own.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, SEQ_LEN))
    torch.testing.assert_close(model(ids).logits, own(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("model", "words"), [
    (f"{ROOT / 'tests/user_models/sdpa_positions.py'}:build_without_positions",
     "ArangeModel cannot be told its tokens' positions: give its forward a position_ids argument"),
    (f"hf:gemma3_text:{_HF},head_dim=8,use_bidirectional_attention=true",
     "Gemma3ForCausalLM is built with use_bidirectional_attention=true"),
    # MiniMax's lightning (linear) attention layers mix the sequence without SDPA
    ("hf:minimax:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,head_dim=16,"
     "intermediate_size=64,vocab_size=128,max_position_embeddings=64,num_local_experts=4,num_experts_per_tok=2",
     "MiniMaxForCausalLM has layers that are not attention (linear_attention)"),
])
def test_cp_is_refused_in_one_line_for_a_model_that_cannot_be_told_its_positions(model, words):
    result = run_main("suggest", "--model", model, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32",
                      "--cp", "2")
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_router_loss_autoplan_cannot_compute_over_cp_is_refused(monkeypatch):
    """A transformers MoE model whose router loss is not the Switch loss `balance_loss` computes
    again (here: the check made to fail) is refused cp in one line, before any process starts; one
    without a router loss (DeepSeek-V3 returns router logits and no aux loss) is not."""
    from autoplan.cli import main
    from autoplan.sources import hf_context

    monkeypatch.setattr(hf_context, "recomputes_balance_loss", lambda config, model_class: False)
    spec = MODELS["hf-mixtral"] + ",output_router_logits=true"
    code = main(["suggest", "--model", spec, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32",
                 "--cp", "2"])
    assert code == 2
    from autoplan.sources import parse_source

    refusal = parse_source(spec).context_parallel_refusal(None)
    assert refusal.startswith("MixtralForCausalLM is built with output_router_logits=true, and its router loss is "
                              "not the Switch load-balancing loss") and "\n" not in refusal
    deepseek = parse_source("hf:deepseek_v3:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=128,"
                            "max_position_embeddings=64,num_key_value_heads=4,intermediate_size=64,moe_intermediate_size=32,"
                            "n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1,first_k_dense_replace=1,"
                            "q_lora_rank=32,kv_lora_rank=16,qk_rope_head_dim=8,qk_nope_head_dim=8,v_head_dim=16,"
                            "n_group=1,topk_group=1,output_router_logits=true")
    assert deepseek.context_parallel_refusal(None) is None
