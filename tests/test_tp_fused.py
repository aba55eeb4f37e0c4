"""Tensor parallelism shards what it says (issue 31, items 4 and 5): fused q/k/v and gate/up
projections (Phi-3, Falcon) are column-parallel block by block, per-head q/k norms (Qwen3, OLMo2)
shard with their heads, and an attention left whole on every tp rank is listed in the layout, shown
by `suggest` and priced as replicated.

The numerics go through what a user runs (`autoplan.suggest` with the layout pinned, then
`autoplan.partition(...).step` on 4 gloo ranks, tests/test_user_paths.py's `_check_spec`) against a
single-process reference: loss and every gradient.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from test_user_paths import LAYOUTS, _check_spec  # noqa: E402

import autoplan  # noqa: E402

pytestmark = pytest.mark.hf

_DECODER = ("num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,vocab_size=256,"
            "max_position_embeddings=64")
_FALCON = "hf:falcon:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=256"
SHARDED = {
    # Phi-3-mini's layout: q, k and v fused into `qkv_proj` and sliced apart, gate and up fused into
    # `gate_up_proj` and chunked apart.
    "phi3": f"hf:phi3:{_DECODER},pad_token_id=0",
    # Falcon-40B's layout: q, k and v fused per key/value group (`new_decoder_architecture`).
    "falcon": f"{_FALCON},new_decoder_architecture=True,num_kv_heads=2",
    # Falcon's multi-head layout: q, k and v fused per head (`view(b, s, heads, 3, head_dim)`).
    "falcon-mha": f"{_FALCON},multi_query=False",
    # RMSNorm over each head's q and k (head_dim) after the per-head view.
    "qwen3": f"hf:qwen3:{_DECODER},num_key_value_heads=2,head_dim=16",
    # RMSNorm over the whole q and k projections: its statistics need every tp rank's heads.
    "olmo2": f"hf:olmo2:{_DECODER},num_key_value_heads=2",
}
REPLICATED = {
    # CodeGen's layout: qkv_proj's output is reshaped into `mp_num` (4) groups, each [q | v | k] of
    # heads / 4 heads: with 8 heads, neither groups of one query head beside its key and value nor a
    # [q | k | v] cut, so its attention stays whole on every tp rank. (GPT-BigCode's and Falcon's
    # multi-query and Phi-3's grouped-query attention are sharded: tests/test_tp_attention_families.py,
    # tests/test_tp_bigcode_mqa.py.)
    "codegen": ("hf:codegen:n_layer=2,n_embd=128,n_head=8,rotary_dim=8,vocab_size=256,n_positions=64,n_ctx=64",
                "attn"),
}


def _layout(spec: str) -> dict:
    return autoplan.profile(spec, seq_len=32).extra["tensor_parallel"]


@pytest.mark.parametrize("name", list(SHARDED))
def test_attention_is_sharded(name):
    """Every layer's attention and MLP are sharded: nothing is left replicated, tp divides the
    heads, and a layer's parameters are sharded but for its norms."""
    layout = _layout(SHARDED[name])
    assert layout["replicated"] == {} and not layout["note"], layout
    assert layout["divides"]["num_heads"] == 4 and layout["divides"]["ffn_hidden_size"] > 0, layout
    assert all(share > 0.99 for share in layout["block_sharded_share"][1:3]), layout


BOTH = ("tp2", "tp2-pp2")


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "layouts"), [
    pytest.param("phi3", ("tp2-pp2",), id="phi3-tp2-pp2"),  # the default tier's: fused q/k/v and gate/up, a cut
    pytest.param("phi3", ("tp2",), marks=pytest.mark.extended, id="phi3-tp2"),
    pytest.param("falcon", BOTH, marks=pytest.mark.extended, id="falcon"),
    pytest.param("falcon-mha", BOTH, marks=pytest.mark.extended, id="falcon-mha"),
    pytest.param("qwen3", BOTH, marks=pytest.mark.extended, id="qwen3"),
    pytest.param("olmo2", BOTH, marks=pytest.mark.extended, id="olmo2"),
])
def test_tp_matches_a_single_process_reference(name, layouts):
    """tp 2 (x dp 2) and tp 2 x pp 2 on 4 gloo ranks: the loss and every gradient of the reference."""
    spec = SHARDED[name] if name in SHARDED else REPLICATED[name][0]
    _check_spec(spec, 32, {k: LAYOUTS[k] for k in layouts}, set())


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_fused_projection_shards_block_by_block_and_every_layer_attends_its_own_heads():
    """Phi-3's fused `qkv_proj` holds 1/tp of each of q, k and v on each rank ([q_r | k_r | v_r]),
    and `gate_up_proj` 1/tp of each of gate and up: the local weight is 1/tp of the rows, and its
    full tensor is the model's own. Every layer's attention runs on this rank's heads (2 of 4): the
    row-parallel outputs are all-reduced where Megatron-LM all-reduces them, so no later layer
    computes its projections whole as partial sums."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tests._dist import run_ranks

    plan = autoplan.suggest(SHARDED["phi3"], "1x2xcpu", global_batch=2, seq_len=16, tp=2, pp=1, dp=1,
                            dtype="fp32", micro_batch_size=1)[0]
    results = run_ranks(_local_weights, 2, SHARDED["phi3"], plan, timeout_s=300)
    for rank, (weights, attended) in results.items():
        for name, parts in (("model.layers.0.self_attn.qkv_proj.weight", 3), ("model.layers.0.mlp.gate_up_proj.weight", 2)):
            local, full, placement = weights[name]
            assert local.shape[0] * 2 == full.shape[0]
            assert isinstance(placement, _StridedShard) and placement.split_factor == parts
            blocks = full.chunk(parts)
            torch.testing.assert_close(local, torch.cat([b.chunk(2)[rank] for b in blocks]))
        assert len(attended) == 2 * plan.num_microbatches, attended  # 2 layers per micro-batch
        assert all(placements == (Shard(1),) and local_heads == 2 for placements, local_heads in attended), attended


def _local_weights(rank, world_size, spec, plan):
    import autoplan.runtime.parallel.tensor_parallel_graph as graph_tp

    attended = []
    attention = graph_tp._local_attention

    def spy(q, *args, **kwargs):  # placement and local heads of q as each layer's attention gets it
        attended.append((tuple(q.placements), q.to_local().shape[1]))
        return attention(q, *args, **kwargs)

    graph_tp._local_attention = spy  # before partition rewrites the graph's attention calls
    try:
        pm = autoplan.partition(spec, plan, device="cpu")
        template = pm.output_template
        inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape,
                                         template.dtype)
        pm.step(*inputs, target=target)
    finally:
        graph_tp._local_attention = attention
    weights = {}
    for name, p in pm.named_parameters():
        if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            weights[name] = (p.to_local().detach().clone(), p.full_tensor().detach().clone(), p.placements[0])
    return weights, attended


@pytest.mark.parametrize("name", ["codegen"])
def test_an_attention_left_whole_is_listed_shown_and_priced(name, tmp_path):
    """A model whose attention tp cannot shard still runs its MLP tensor-parallel: the attention is
    in the layout's `replicated` list, `autoplan suggest` says so, and the plan prices its
    parameters whole on every tp rank."""
    spec, module = REPLICATED[name]
    layout = _layout(spec)
    assert len(layout["replicated"]) == 2 and all(p.endswith(module) for p in layout["replicated"]), layout
    share = layout["block_sharded_share"][1]
    assert 0.3 < share < 0.9, layout  # the MLP sharded, the attention not

    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", spec, "--cluster", "1x2xcpu",
                           "--global-batch", "4", "--seq-len", "32", "--tp", "2", "--pp", "1", "--dtype", "fp32",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "tp 2 leaves" in text and module in text, proc.stdout
    plan = json.loads(out.read_text())
    assert any("tp 2 leaves" in note for note in plan["notes"]), plan["notes"]

    # The weights a tp rank holds: the sharded half, the replicated whole (fp32 weights: 4 bytes).
    prof = autoplan.profile(spec, seq_len=32)
    params = sum(b.num_params for b in prof.blocks)
    sharded = layout["sharded_params"]
    predicted = plan["stages"][0]["memory"]["weights_bytes"]
    assert predicted == pytest.approx(4 * (sharded / 2 + params - sharded), rel=0.02), (predicted, sharded, params)
    assert predicted > 4 * params / 2 * 1.1


QK_NORM_FILE = str(Path(__file__).resolve().parent / "user_models" / "qk_norm.py")


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("build", ["build_head", "build_full"])
def test_qk_norms_under_module_hooks(build):
    """A model file traced with fx (attention called whole: tp by module hooks): a per-head q/k norm
    shards with the heads; one over the whole projection would see this rank's part only, so that
    attention is listed as replicated and the MLP alone is sharded. Both match the reference."""
    spec = f"{QK_NORM_FILE}:{build}"
    layout = _layout(spec)
    if build == "build_head":
        assert layout["replicated"] == {} and layout["divides"]["num_heads"] == 4, layout
    else:
        assert sorted(layout["replicated"]) == ["layers.0.attn", "layers.1.attn"], layout
    _check_spec(spec, 32, {k: LAYOUTS[k] for k in BOTH}, set())
