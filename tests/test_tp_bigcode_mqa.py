"""GPT-BigCode's multi-query attention sharded (issue 43, item 2): `c_attn` is one fused linear
producing [q (all heads) | k (1 head) | v (1 head)], cut by `c_attn(x).unsqueeze(1).split((embed,
kv, kv), dim=3)`. Under tp, q's rows (heads) are column-parallel, the one key and value head whole on
every rank (their gradients all-reduced over tp) and `c_proj` row-parallel, as Falcon's multi-query
attention (tests/test_tp_attention_families.py).

Through what a user runs: the layout `autoplan.profile` records (what `suggest` prices), then a plan
from `autoplan.suggest` run by `autoplan.partition(...).step` on gloo ranks: each attention
parameter's local shape, and the loss and every gradient against a single process (fp32).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _dist import run_ranks  # noqa: E402
from test_user_paths import GLOBAL_BATCH, LAYOUTS, MICRO_BATCH, _check_spec, _full, _reference  # noqa: E402

import autoplan  # noqa: E402

pytestmark = pytest.mark.hf

# Dropout 0 (GPT-BigCode's default is 0.1) so that the ranks and the single process compute the same.
SPEC = ("hf:gpt_bigcode:n_layer=2,n_embd=64,n_head=4,n_inner=128,vocab_size=256,n_positions=64,multi_query=True,"
        "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0")
# Attention parameter (layer 0) -> its (local, whole) shape on a tp 2 rank: [q_r | k | v], 2 query
# heads of 16 features beside the one key and one value head whole.
LOCAL_SHAPES = {
    "transformer.h.0.attn.c_attn.weight": ((32 + 16 + 16, 64), (96, 64)),
    "transformer.h.0.attn.c_attn.bias": ((32 + 16 + 16,), (96,)),
    "transformer.h.0.attn.c_proj.weight": ((64, 32), (64, 64)),
    "transformer.h.0.attn.c_proj.bias": ((64,), (64,)),
}


def test_multi_query_attention_is_sharded_in_the_profile():
    """The layout the profile records shards each layer's attention (none left whole, tp divides the
    heads) and its sharded share counts q and c_proj but not the whole key and value head. Left
    whole (before issue 43's last family), the share was the MLP's alone: 16576 / 27232 = 0.61."""
    layout = autoplan.profile(SPEC, seq_len=32).extra["tensor_parallel"]
    assert layout["replicated"] == {} and not layout["note"], layout
    assert layout["divides"]["num_heads"] == 4 and "num_kv_heads" not in layout["divides"], layout
    assert layout["fused_qkv"], layout
    # A layer's parameters: c_attn 64 x 96 + 96 (of which q's 64 x 64 + 64 sharded), c_proj 64 x 64
    # + 64, the MLP 64 x 128 + 128 + 128 x 64 + 64, two norms of 2 x 64.
    c_attn, q, c_proj, mlp, norms = 64 * 96 + 96, 64 * 64 + 64, 64 * 64 + 64, 2 * 64 * 128 + 128 + 64, 4 * 64
    share = (q + c_proj + mlp) / (c_attn + c_proj + mlp + norms)
    assert layout["block_sharded_share"][1] == pytest.approx(share, abs=1e-4), layout["block_sharded_share"]


def _tp2_job(rank, world_size, spec, plan):
    """Loss, gradients (full tensors), gathered attention weights and each parameter's (local, full)
    shape on this rank, and clipping's global norm."""
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
    weights = {n: _full(p) for n, p in pm.named_parameters() if ".attn." in n}
    norm = float(pm.clip_grad_norm_(1e9))  # the global norm (max_norm above it: nothing clipped)
    return dict(loss=None if loss is None else float(loss), shapes=shapes, grads=grads, weights=weights,
                batch=(inputs, target), norm=norm)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_tp2_shards_q_and_c_proj_and_matches_one_process():
    """tp 2 on 2 gloo ranks: q's rows and c_proj's columns are each rank's heads, the key and value
    rows whole; the gathered weights are the model's own [q | k | v], and the loss, every gradient
    and clipping's global norm (the whole key and value counted once) equal the single process's."""
    import torch

    plan = autoplan.suggest(SPEC, "1x2xcpu", global_batch=GLOBAL_BATCH, seq_len=32, tp=2, pp=1, dp=1, dtype="fp32",
                            micro_batch_size=MICRO_BATCH, top=1)[0]
    assert plan.tp == 2 and not any("whole on every tp rank" in note for note in plan.notes), plan.notes
    results = run_ranks(_tp2_job, 2, SPEC, plan, timeout_s=600, pg_timeout_s=120)
    for rank, out in results.items():
        for param, expected in LOCAL_SHAPES.items():
            assert out["shapes"][param] == expected, (rank, param, out["shapes"][param])
    inputs, target = results[0]["batch"]
    model, ref_loss, ref_grads = _reference(SPEC, plan, inputs, target)
    reference = dict(model.named_parameters())
    for rank, out in results.items():
        assert out["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6), (rank, out["loss"], ref_loss)
        assert set(out["weights"]) >= set(LOCAL_SHAPES), sorted(out["weights"])
        for param, value in out["weights"].items():
            torch.testing.assert_close(value, reference[param].detach(), msg=param)
    grads = results[0]["grads"]
    # the head is tied to the token table: one tensor under two names, listed once
    same = {n: next(m for m, q in model.named_parameters(remove_duplicate=False) if q is p)
            for n, p in model.named_parameters(remove_duplicate=False)}
    assert set(grads) <= set(ref_grads) and all(n in grads or same[n] in grads for n in ref_grads), \
        sorted(set(grads) ^ set(ref_grads))
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for param, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[param], rtol=1e-4, atol=1e-4 * scale, msg=param)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([ref_grads[n].norm() for n in grads])))
    for rank, out in results.items():
        assert out["norm"] == pytest.approx(ref_norm, rel=1e-4), (rank, out["norm"], ref_norm)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_tp2_pp2_matches_one_process():
    """tp 2 x pp 2 on 4 gloo ranks: the loss and every gradient of the reference."""
    _check_spec(SPEC, 32, {"tp2-pp2": LAYOUTS["tp2-pp2"]}, set())


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(1500)
def test_tp2_checkpoints_and_resumes_exactly_through_the_cli(tmp_path, monkeypatch):
    """`autoplan suggest` / `autoplan run` at tp 2: c_attn's weight and bias, held in parts (q's
    rows sharded, the key and value rows whole), go through a checkpoint box by box, a resumed run
    trains as the straight one, and the exported state dict is the model's own
    (tests/test_tp_attention_families.py's check, on this model)."""
    import test_tp_attention_families as families

    monkeypatch.setitem(families.SPECS, "bigcode-mqa", SPEC)
    families.test_a_blocked_fused_projection_checkpoints_and_resumes_exactly("bigcode-mqa", tmp_path)
