"""Expert parallelism for routed experts (graph/experts.py: forward(tokens, expert indices, weights)):
transformers' Mixtral, Qwen2-MoE and DeepSeek-V3 experts and the zoo's dropless routing, as a user
plans and runs them: `autoplan suggest ... --ep 2 --out plan.json` (the CLI), then each of 4 gloo
ranks builds its stages from the plan file with `autoplan.partition(spec, plan.json)` and trains a
step, against a single-process reference of the whole model (loss, and every gradient, the experts'
slices put back together). Dropless dispatch and expert tp 1 under tp 2 (runtime/parallel/routed_experts.py)
are exact up to rounding."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from test_expert_parallel import check_against_reference, step_and_collect
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH

import autoplan
from autoplan.cli import main

_DECODER = "hidden_size=64,num_attention_heads=4,vocab_size=128,max_position_embeddings=64"
MODELS = {
    "hf-mixtral": f"hf:mixtral:num_hidden_layers=2,{_DECODER},num_key_value_heads=2,intermediate_size=64,"
                  "num_local_experts=4,num_experts_per_tok=2",
    "hf-qwen2-moe": f"hf:qwen2_moe:num_hidden_layers=2,{_DECODER},num_key_value_heads=2,intermediate_size=64,"
                    "moe_intermediate_size=32,shared_expert_intermediate_size=64,num_experts=4,num_experts_per_tok=2",
    "hf-deepseek-v3": f"hf:deepseek_v3:num_hidden_layers=2,{_DECODER},num_key_value_heads=4,intermediate_size=64,"
                      "moe_intermediate_size=32,n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1,"
                      "first_k_dense_replace=1,q_lora_rank=32,kv_lora_rank=16,qk_rope_head_dim=8,qk_nope_head_dim=8,"
                      "v_head_dim=16,n_group=1,topk_group=1",
    "zoo-moe-dropless": "moe:num_layers=2,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=64,vocab_size=128,"
                        "max_seq_len=64,num_experts=4,experts_per_token=2,num_shared_experts=1,dropless=true",
}
SEQ_LEN = 32
LAYOUTS = {
    "ep2": ["--tp", "1", "--pp", "1", "--dp", "4", "--ep", "2"],
    "ep2-pp2": ["--tp", "1", "--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "1f1b"],
    "ep2-tp2": ["--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2"],  # expert tp 1: each tp rank sends half the tokens
    "ep2-zero3": ["--tp", "1", "--pp", "1", "--dp", "4", "--ep", "2", "--zero", "3"],  # experts: FSDP units of their own
    # FSDP under tp: the ep group folded over tp x dp, each tp rank's experts sharded over their own mesh
    "ep2-tp2-zero3": ["--tp", "2", "--pp", "1", "--dp", "2", "--ep", "2", "--zero", "3"],
    "ep4-tp2-zero3": ["--tp", "2", "--pp", "1", "--dp", "2", "--ep", "4", "--zero", "3"],  # ep beyond dp
    "ep2-hsdp": ["--tp", "1", "--pp", "1", "--dp", "4", "--ep", "2", "--zero", "3", "--dp-replicate", "2"],
    # cp 2: each rank's chunks of a sequence are tokens of its own to the experts (routed token by token)
    "cp2-ep2": ["--tp", "1", "--pp", "1", "--dp", "4", "--cp", "2", "--ep", "2"],
}


def _suggest(spec: str, pins: list[str], out) -> None:
    """`autoplan suggest ... --out` (the CLI's entry point in this process: a fresh interpreter per
    plan costs seconds of the suite)."""
    code = main(["suggest", "--model", spec, "--cluster", "1x4xcpu", "--global-batch", str(GLOBAL_BATCH), "--seq-len",
                 str(SEQ_LEN), "--dtype", "fp32", "--micro-batch-size", str(MICRO_BATCH), *pins, "--out", str(out)])
    assert code == 0


def _rank_job(rank: int, world_size: int, spec: str, plan_files: dict) -> dict:
    return {name: step_and_collect(autoplan.partition(spec, path, device="cpu"), rank) for name, path in plan_files.items()}


def _check(model: str, layouts: list[str], tmp_path) -> None:
    spec = MODELS[model]
    files = {}
    for name in layouts:
        files[name] = tmp_path / f"{name}.json"
        _suggest(spec, LAYOUTS[name], files[name])
    results = run_ranks(_rank_job, 4, spec, {n: str(f) for n, f in files.items()}, timeout_s=500, pg_timeout_s=120)
    for name, path in files.items():
        plan = autoplan.Plan.load(path)
        assert plan.ep == int(LAYOUTS[name][LAYOUTS[name].index("--ep") + 1]) and plan.expert_tp == 1, (name, plan.ep)
        check_against_reference(spec, f"{name}", plan, results)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_hf_mixtral_at_ep2_matches_a_single_process(tmp_path):
    """`--ep 2` on a transformers Mixtral was refused (its experts take ungrouped tokens); now its
    experts are split over the ep ranks with dropless all-to-all dispatch."""
    _check("hf-mixtral", ["ep2"], tmp_path)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_hf_mixtral_at_cp2_with_ep2_matches_a_single_process(tmp_path):
    """`--cp 2 --ep 2` on a transformers Mixtral: its routers pick experts token by token and, with
    output_router_logits off (transformers' default), count nothing over the batch
    (sources/hf.py `routes_tokens_alone`), so each cp rank's chunks go to the experts as tokens of
    their own."""
    _check("hf-mixtral", ["cp2-ep2"], tmp_path)


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", list(MODELS))
def test_routed_experts_every_layout_matches_a_single_process(model, tmp_path):
    # Mixtral's ep2 and cp2-ep2: the default tier
    layouts = [n for n in LAYOUTS if not (model == "hf-mixtral" and n in ("ep2", "cp2-ep2"))]
    _check(model, layouts, tmp_path)


def test_hf_moe_models_profile_their_routed_experts():
    """The profile records transformers' experts (found from the exported graph: stacked parameters,
    a call of (tokens, expert indices, weights)) and the rows they receive: tokens x k x hidden."""
    spec = MODELS["hf-mixtral"]
    experts = autoplan.profile(spec, seq_len=SEQ_LEN).extra["experts"]
    assert experts["num_experts"] == 4
    per_layer = 3 * 4 * 64 * 64  # gate and up (fused), down: (experts, 2 * ffn, hidden) + (experts, hidden, ffn)
    assert experts["block_params"][1:3] == [per_layer] * 2 and experts["block_params"][0] == 0
    assert experts["block_dispatch_bytes"][1:3] == [SEQ_LEN * 2 * 64 * 2] * 2  # one sequence, k = 2, bf16
    plan = autoplan.suggest(spec, "1x4xcpu", global_batch=8, seq_len=SEQ_LEN, ep=2, top=1)[0]
    assert plan.ep == 2 and plan.predicted.breakdown["ep_comm_s"] > 0


def test_dropless_routing_plans_and_counts_every_token():
    """`dropless=true` routes every token to its k experts: FLOPs of exactly k experts per token,
    where capacity routing computes capacity_factor times as many slots (padding included)."""
    dropless = MODELS["zoo-moe-dropless"]
    capacity = dropless.replace(",dropless=true", "")
    one, two = (autoplan.profile(s, seq_len=SEQ_LEN, dtype="fp32") for s in (dropless, capacity))
    assert one.extra["experts"]["num_experts"] == 4
    assert one.blocks[1].fwd_flops < two.blocks[1].fwd_flops
    plan = autoplan.suggest(dropless, "1x4xcpu", global_batch=8, seq_len=SEQ_LEN, ep=2, top=1)[0]
    assert plan.ep == 2


class _Experts(torch.nn.Module):
    """Routed experts by the contract's facts: `num_experts`, stacked weights, (tokens, indices, weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, tokens, indices, weights):
        return (torch.einsum("th,tkhg->tkg", tokens, self.w[indices]) * weights.unsqueeze(-1)).sum(1)


class _MoE(torch.nn.Module):
    """A router and its experts, run once or (`twice`) twice per forward: then no one exchange of
    tokens serves them."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.router, self.experts, self.twice = torch.nn.Linear(8, 4), _Experts(), twice

    def forward(self, x):
        weights, indices = self.router(x).softmax(-1).topk(2, -1)
        out = self.experts(x, indices, weights)
        return self.experts(out, indices, weights) if self.twice else out


@pytest.mark.parametrize(("tracer", "twice", "words"), [
    ("export", True, "'experts' is called 2 times"),
    ("fx", False, "the graph inlines 'experts' without the shapes of its inputs (fx); keep it whole with --leaf-modules"),
])
def test_experts_the_graph_does_not_call_once_are_refused_in_one_line(tracer, twice, words):
    """Before any process group (runtime/parallel/experts.py `refuse_expert_parallel`), one line saying why."""
    from types import SimpleNamespace

    from autoplan.graph.trace import trace_model
    from autoplan.runtime.parallel.errors import PartitionError
    from autoplan.runtime.parallel.experts import refuse_expert_parallel

    model = _MoE(twice)
    traced = trace_model(model, (torch.randn(6, 8),), tracer=tracer)
    with pytest.raises(PartitionError) as info:
        refuse_expert_parallel(model, traced, SimpleNamespace(ep=2))
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
