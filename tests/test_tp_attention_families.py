"""Attention sharded in every family (issue 43, item 2): a fused q/k/v projection with grouped-query
heads (Phi-3 with fewer key/value heads than heads) split per key/value group, multi-query Falcon
(`multi_query=True`, the default) with q sharded and its one key/value head whole on every rank, and
DeepSeek-V3's multi-head latent attention with its per-head projections sharded and its latent
down-projections whole.

Through what a user runs: the layout `autoplan.profile` records (what `suggest` prices), then a plan
from `autoplan.suggest` run by `autoplan.partition(...).step` on gloo ranks: each attention
parameter's local shape on a rank, and the loss and every gradient against a single process
(tests/test_user_paths.py's reference and `_check_spec`, fp32).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _dist import run_ranks  # noqa: E402
from test_user_paths import GLOBAL_BATCH, LAYOUTS, MICRO_BATCH, _check_spec, _full, _reference  # noqa: E402

import autoplan  # noqa: E402

pytestmark = pytest.mark.hf

_DECODER = ("num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=256,"
            "max_position_embeddings=64")
SPECS = {
    # Phi-3-medium's layout: [q | k | v] fused in `qkv_proj`, 2 key/value heads for 4 query heads.
    "phi3-gqa": f"hf:phi3:{_DECODER},pad_token_id=0,num_key_value_heads=2",
    # Falcon-7B's layout: multi-query, `view(b, s, heads + 2, head_dim)` with one key and one value head.
    "falcon-mqa": "hf:falcon:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=256,multi_query=True",
    # DeepSeek-V3's multi-head latent attention (q_lora_rank 32, kv_lora_rank 16), a dense then an MoE layer.
    "deepseek-v3": ("hf:deepseek_v3:num_hidden_layers=2,hidden_size=64,intermediate_size=128,moe_intermediate_size=32,"
                    "num_attention_heads=4,num_key_value_heads=4,vocab_size=256,n_routed_experts=4,"
                    "num_experts_per_tok=2,n_shared_experts=1,first_k_dense_replace=1,q_lora_rank=32,kv_lora_rank=16,"
                    "qk_rope_head_dim=8,qk_nope_head_dim=8,v_head_dim=16,max_position_embeddings=64,n_group=1,"
                    "topk_group=1"),
}
# Attention parameter (layer 0) -> its rows (dim 0) and columns (dim 1) on a tp 2 rank, of the whole.
LOCAL_SHAPES = {
    "phi3-gqa": {
        # [q_r | k_r | v_r]: 2 query heads, the key/value head of their group (16 features each)
        "model.layers.0.self_attn.qkv_proj.weight": ((32 + 16 + 16, 64), (128, 64)),
        "model.layers.0.self_attn.o_proj.weight": ((64, 32), (64, 64)),
    },
    "falcon-mqa": {
        # [q_r | k | v]: 2 query heads, the one key and value head whole
        "transformer.h.0.self_attention.query_key_value.weight": ((32 + 16 + 16, 64), (96, 64)),
        "transformer.h.0.self_attention.dense.weight": ((64, 32), (64, 64)),
    },
    "deepseek-v3": {
        "model.layers.0.self_attn.q_b_proj.weight": ((32, 32), (64, 32)),  # 2 heads of (8 + 8)
        "model.layers.0.self_attn.kv_b_proj.weight": ((48, 16), (96, 16)),  # 2 heads of (8 + 16)
        "model.layers.0.self_attn.o_proj.weight": ((64, 32), (64, 64)),
        # the latent down-projections: whole on every rank
        "model.layers.0.self_attn.q_a_proj.weight": ((32, 64), (32, 64)),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ((24, 64), (24, 64)),
    },
}


@pytest.mark.parametrize("name", list(SPECS))
def test_no_attention_is_left_whole(name):
    """The layout the profile records (what suggest prices) shards every layer's attention: none is
    listed as left whole, tp must divide the heads (and the key/value heads where they are sharded),
    and the share of each layer's parameters that is sharded counts the attention."""
    layout = autoplan.profile(SPECS[name], seq_len=32).extra["tensor_parallel"]
    assert layout["replicated"] == {} and not layout["note"], layout
    assert layout["divides"]["num_heads"] == 4, layout
    assert layout["divides"].get("num_kv_heads") == (2 if name == "phi3-gqa" else None), layout
    shares = layout["block_sharded_share"]
    # Phi-3: all but the norms; DeepSeek-V3's dense layer: all but norms and latent projections;
    # Falcon: all but the norms and its one key and value head, whole on every rank (a third of the
    # fused projection's 96 rows at these sizes)
    low, high = {"phi3-gqa": (0.99, 1.0), "deepseek-v3": (0.85, 1.0), "falcon-mqa": (0.9, 0.99)}[name]
    assert low < shares[1] < high, shares


def test_tp_refuses_more_ranks_than_key_value_groups():
    """Phi-3 with 2 key/value heads: tp 4 would split a group, and is refused in one line."""
    with pytest.raises(ValueError, match="key/value heads") as err:
        autoplan.suggest(SPECS["phi3-gqa"], "1x4xcpu", global_batch=4, seq_len=16, tp=4, pp=1, dp=1, dtype="fp32")
    assert "\n" not in str(err.value)


def _tp2_job(rank, world_size, spec, plan):
    """Loss, gradients (full tensors) and each parameter's (local, full) shape on this rank."""
    pm = autoplan.partition(spec, plan, device="cpu")
    template = pm.output_template
    inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    loss = pm.step(*inputs, target=target)
    shapes, grads = {}, {}
    for name, p in pm.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        shapes[name] = (tuple(local.shape), tuple(p.shape))
        if p.grad is not None:
            grads[name] = _full(p.grad)
    full_weights = {n: _full(p) for n, p in pm.named_parameters() if "self_attn" in n or "self_attention" in n}
    norm = float(pm.clip_grad_norm_(1e9))  # the global norm (max_norm above it: nothing clipped)
    return dict(loss=None if loss is None else float(loss), shapes=shapes, grads=grads, weights=full_weights,
                batch=(inputs, target), norm=norm)


def _check_tp2(name: str) -> None:
    import torch

    spec = SPECS[name]
    plan = autoplan.suggest(spec, "1x2xcpu", global_batch=GLOBAL_BATCH, seq_len=32, tp=2, pp=1, dp=1, dtype="fp32",
                            micro_batch_size=MICRO_BATCH, top=1)[0]
    assert plan.tp == 2 and not any("whole on every tp rank" in note for note in plan.notes), plan.notes
    results = run_ranks(_tp2_job, 2, spec, plan, timeout_s=600, pg_timeout_s=120)
    for rank, out in results.items():
        for param, expected in LOCAL_SHAPES[name].items():
            assert out["shapes"][param] == expected, (rank, param, out["shapes"][param])
    inputs, target = results[0]["batch"]
    model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
    for rank, out in results.items():
        assert out["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6), (rank, out["loss"], ref_loss)
        # the whole weights a rank gathers (checkpoints, state dicts) are the model's own layout
        reference = dict(model.named_parameters())
        for param, value in out["weights"].items():
            torch.testing.assert_close(value, reference[param].detach(), msg=param)
    grads = results[0]["grads"]
    # a tied parameter (Falcon's head and token table) is one tensor under two names, listed once
    same = {n: next(m for m, q in model.named_parameters(remove_duplicate=False) if q is p)
            for n, p in model.named_parameters(remove_duplicate=False)}
    assert set(grads) <= set(ref_grads) and all(n in grads or same[n] in grads for n in ref_grads), \
        sorted(set(grads) ^ set(ref_grads))
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for param, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[param], rtol=1e-4, atol=1e-4 * scale, msg=param)
    # clipping's global norm counts a part whole on every tp rank (a multi-query key and value) once
    # (over the parameters the partitioned model lists: a tied weight once)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([ref_grads[n].norm() for n in grads])))
    for rank, out in results.items():
        assert out["norm"] == pytest.approx(ref_norm, rel=1e-4), (rank, out["norm"], ref_norm)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [
    "phi3-gqa",  # the default tier's: grouped-query heads in a fused projection
    pytest.param("falcon-mqa", marks=pytest.mark.extended),
    pytest.param("deepseek-v3", marks=pytest.mark.extended),
])
def test_tp2_shards_every_attention_projection_and_matches_one_process(name):
    """tp 2 on 2 gloo ranks: each attention parameter's local shape is its rank's heads (the latent
    down-projections whole), the gathered weights are the model's own, and the loss and every
    gradient equal the single process's."""
    _check_tp2(name)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(SPECS))
def test_tp2_and_tp2_pp2_match_one_process(name):
    """tp 2 x dp 2 and tp 2 x pp 2 on 4 gloo ranks: the loss and every gradient of the reference."""
    _check_spec(SPECS[name], 32, {k: LAYOUTS[k] for k in ("tp2", "tp2-pp2")}, set())


def test_a_multi_query_key_and_value_left_whole_are_not_counted_sharded():
    """The share of a fused projection each rank holds 1/tp of excludes its parts left whole (the
    one key and value head of multi-query attention), as the layout's sharded parameter count does."""
    from autoplan.graph.tp_layout import TensorParallelLayout

    layout = TensorParallelLayout(styles={"qkv": "colwise-qkv", "o": "rowwise"},
                                  blocks={"qkv": ((64, False), (16, True), (16, True))})
    assert layout.sharded_share("qkv") == pytest.approx(64 / 96)
    assert layout.sharded_share("o") == 1.0 and layout.sharded_share("norm") == 0.0
    profiled = autoplan.profile(SPECS["falcon-mqa"], seq_len=32).extra["tensor_parallel"]
    # 2 layers' key and value rows (2 x 16 of 64 inputs each) are the parameters of styled modules not sharded
    assert profiled["sharded_params"] == 98304, profiled


def _cli(*args: str, timeout: int = 900):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["phi3-gqa", "falcon-mqa"])
def test_a_blocked_fused_projection_checkpoints_and_resumes_exactly(name, tmp_path):
    """A fused projection sharded part by part goes through torch.distributed.checkpoint box by box
    (checkpoint/planners.py [Note: strided shards in DCP]): at tp 2, a run saved after step 2 and
    resumed trains step 3 bitwise as the straight run (weights and AdamW state read back into the
    right rows), and the exported state dict loads into the transformers model it names."""
    import json

    import torch

    plan = tmp_path / "p.json"
    made = _cli("suggest", "--model", SPECS[name], "--cluster", "1x2xcpu", "--global-batch", "4", "--seq-len", "32",
                "--tp", "2", "--pp", "1", "--dp", "1", "--dtype", "fp32", "--out", str(plan))
    assert made.returncode == 0, made.stderr[-2000:]

    def losses(metrics):
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    ran = _cli("run", str(plan), "--nproc", "2", "--steps", "3", "--metrics", str(straight))
    assert ran.returncode == 0, ran.stderr[-2000:]
    ckpt = tmp_path / "ckpt"
    ran = _cli("run", str(plan), "--nproc", "2", "--steps", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert ran.returncode == 0, ran.stderr[-2000:]
    ran = _cli("run", str(plan), "--nproc", "2", "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume",
               "--metrics", str(resumed))
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert losses(resumed) == losses(straight)[2:], (losses(resumed), losses(straight))
    # The rows themselves: a run whose step moves no weight (lr 1e-30), exported, equals the model
    # built as the ranks build it (a save and a load that agreed on wrong rows would pass the above).
    still = tmp_path / "still"
    ran = _cli("run", str(plan), "--nproc", "2", "--steps", "1", "--lr", "1e-30", "--weight-decay", "0",
               "--checkpoint-dir", str(still))
    assert ran.returncode == 0, ran.stderr[-2000:]
    out = tmp_path / "model.pt"
    exported = _cli("export-checkpoint", str(still), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-2000:]
    from autoplan.sources import parse_source

    torch.manual_seed(0)
    model = parse_source(SPECS[name]).build("cpu")
    saved = torch.load(out)
    for param, value in model.named_parameters():
        torch.testing.assert_close(saved[param], value.detach(), rtol=0, atol=1e-12, msg=param)
