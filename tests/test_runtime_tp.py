"""Tensor-parallel execution (tp > 1) of the zoo models on gloo ranks (torch's parallel styles on
the fx leaf layers): numerics against a single-process reference, 1/tp of the sharded parameters
per rank, state-dict loading, and refusals. Models outside the zoo: test_sharding.py.

One 4-rank spawn runs every multi-rank case (process start-up dominates on a small CPU box).
"""

from __future__ import annotations

import pytest
import torch
from _dist import make_plan, recorded_sends, run_ranks
from models import SkipModel
from torch import nn

from autoplan import models as zoo
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import trace_model
from autoplan.runtime.api import PartitionError, check_model
from autoplan.runtime.parallel.tensor_parallel import check_tp_tracing as _check_tp_tracing
from autoplan.runtime.parallel.tensor_parallel import tensor_parallel_plan

GPT = "gpt:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
LLAMA = "llama:num_layers=4,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"
SEQ = 16


def _data(batch, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, SEQ), generator=gen), torch.randint(0, 64, (batch, SEQ), generator=gen)


def _plan(spec, *, pp, dp=1, tp=2, schedule="1f1b", sequence_parallel=False):
    import dataclasses

    model = zoo.build_model(spec, device="meta")
    traced = trace_model(model, zoo.example_inputs(spec, 1, SEQ, device="meta"))
    plan = make_plan(spec, model_fingerprint(model), traced.block_names, pp=pp, dp=dp, tp=tp, schedule=schedule)
    return dataclasses.replace(plan, sequence_parallel=True) if sequence_parallel else plan


def _reference(spec, plan):
    model = zoo.build_model(spec, device="cpu", seed=0)
    ids, tgt = _data(plan.job.global_batch)
    chunks = plan.dp * plan.num_microbatches
    total = 0.0
    for a, b in zip(ids.chunk(chunks), tgt.chunk(chunks)):
        loss = zoo.lm_loss(model(a), b) / chunks
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def _tp_cases(rank, world_size, cases):
    from torch.distributed.tensor import DTensor

    from autoplan.runtime import partition

    out = []
    for spec, plan, real_weights in cases:
        ids, tgt = _data(plan.job.global_batch)
        if real_weights:
            pm = partition(zoo.build_model(spec, device="cpu", seed=0), plan, example_inputs=(ids[:1],),
                           loss_fn=zoo.lm_loss, example_target=tgt[:1], device="cpu")
        else:
            pm = partition(spec, plan, device="cpu")
        loss = pm.step(ids, target=tgt)
        params = list(pm.named_parameters())
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in params}
        torch.optim.AdamW(pm.parameters(), lr=1e-3).step()  # mixed DTensor / plain parameters
        # load_state_dict writes each rank's slice: load a differently seeded model and gather back.
        other = zoo.build_model(spec, device="cpu", seed=7)
        pm.load_state_dict(other.state_dict(), strict=True)
        loaded_ok = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), other.get_parameter(n))
                        for n, p in params)
        out.append({
            "loss": None if loss is None else float(loss),
            "grads": grads,
            "local_numel": {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in params},
            "placements": {n: str(p.placements[0]) for n, p in params if isinstance(p, DTensor)},
            "loaded_ok": loaded_ok,
        })
    return out


def _check(spec, plan, results, i):
    ref_loss, ref_grads = _reference(spec, plan)
    losses = [r[i]["loss"] for r in results.values() if r[i]["loss"] is not None]
    assert len(losses) == plan.dp * plan.tp  # every tp rank of the last stage has the loss
    for loss in losses:
        assert loss == pytest.approx(ref_loss, rel=1e-4)
    seen = set()
    for rank, rank_results in results.items():
        res = rank_results[i]
        assert res["loaded_ok"], f"rank {rank}: load_state_dict"
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name, r=rank: f"{spec} rank {r} {n}: {m}")
            seen.add(name)
    full = zoo.build_model(spec, device="meta")
    assert {n for n, _ in full.named_parameters()} <= seen
    # Memory: the sharded linears hold 1/tp of their weights (and column-parallel biases); the
    # row-parallel bias is a replicated DTensor; the token embedding and head hold 1/tp of the
    # vocabulary; everything else (norms, position embeddings) is a plain, whole tensor.
    tp_plan = tensor_parallel_plan(full, plan.tp)
    by_name = dict(full.named_parameters(remove_duplicate=False))
    for rank, rank_results in results.items():
        res = rank_results[i]
        expected = {}
        for name in res["local_numel"]:
            module, _, local = name.rpartition(".")
            if module in tp_plan:
                colwise = tp_plan[module] in ("colwise", "vocab-embedding", "vocab-head")  # rows sharded
                expected[name] = "S(0)" if colwise else ("S(1)" if local == "weight" else "R")
        assert res["placements"] == expected and expected, rank
        for name, numel in res["local_numel"].items():
            want = by_name[name].numel() // (plan.tp if expected.get(name, "R") != "R" else 1)
            assert numel == want, f"rank {rank} {name}: {numel} elements, expected {want}"
        sharded = sum(by_name[n].numel() for n, p in expected.items() if p != "R")
        local = sum(res["local_numel"][n] for n, p in expected.items() if p != "R")
        assert local * plan.tp == sharded


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_pp2_tp2_and_dp2_tp2_match_reference_with_sharded_parameters():
    cases = [
        (GPT, _plan(GPT, pp=2), False),
        (LLAMA, _plan(LLAMA, pp=2), False),
        (GPT, _plan(GPT, pp=1, dp=2), False),
        (LLAMA, _plan(LLAMA, pp=2, schedule="zb-h1"), False),
        (GPT, _plan(GPT, pp=2, schedule="gpipe"), True),  # real weights given: sliced after the move
    ]
    results = run_ranks(_tp_cases, 4, cases, timeout_s=110)
    for i, (spec, plan, _) in enumerate(cases):
        _check(spec, plan, results, i)


def _sp_cases(rank, world_size, cases):
    from torch.distributed.tensor import DTensor

    from autoplan.runtime import partition

    out = []
    for spec, plan in cases:
        ids, tgt = _data(plan.job.global_batch)
        with recorded_sends() as sent:
            pm = partition(spec, plan, device="cpu")
            loss = pm.step(ids, target=tgt)
        shapes = [tuple(t.shape) for t in sent]
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in pm.named_parameters()}
        out.append({"loss": None if loss is None else float(loss), "grads": grads, "sent_shapes": shapes})
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_sequence_parallel_matches_reference_and_sends_a_slice_of_the_sequence():
    cases = [(GPT, _plan(GPT, pp=2, sequence_parallel=True)),  # cut between layers 1 and 2: sharded
             (LLAMA, _plan(LLAMA, pp=2, schedule="zb-h1", sequence_parallel=True)),
             (GPT, _plan(GPT, pp=1, dp=2, sequence_parallel=True))]
    results = run_ranks(_sp_cases, 4, cases, timeout_s=110)
    for i, (spec, plan) in enumerate(cases):
        ref_loss, ref_grads = _reference(spec, plan)
        losses = [r[i]["loss"] for r in results.values() if r[i]["loss"] is not None]
        assert len(losses) == plan.dp * plan.tp and all(loss == pytest.approx(ref_loss, rel=1e-4) for loss in losses)
        seen = set()
        for rank, rank_results in results.items():
            for name, grad in rank_results[i]["grads"].items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, r=rank, c=spec: f"{c} sp rank {r} {n}: {m}")
                seen.add(name)
        assert {n for n, _ in zoo.build_model(spec, device="meta").named_parameters()} <= seen
    # GPT blocks: embedding, 4 layers, norm, output; pp = 2 cuts after layer 1 (block 2), so the
    # activations sent are (micro-batch 2, seq 16 / tp 2, hidden 32).
    assert {s for r in results.values() for s in r[0]["sent_shapes"]} == {(2, 8, 32)}

# ---- refusals (no process group) ---------------------------------------------------------------


def test_tp_plan_shards_the_megatron_linears_of_both_families():
    gpt = tensor_parallel_plan(zoo.build_model(GPT, device="meta"), 2)
    assert gpt["layers.0.attention.qkv"] == "colwise" and gpt["layers.3.mlp.fc2"] == "rowwise"
    assert len(gpt) == 4 * 4 + 2 and gpt["tok_embeddings"] == "vocab-embedding" and gpt["output"] == "vocab-head"
    assert not any(k.startswith(("pos_", "norm")) for k in gpt)
    llama = tensor_parallel_plan(zoo.build_model(LLAMA, device="meta"), 2)
    assert {k.rpartition(".")[2]: v for k, v in llama.items()} == {
        "wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise", "w1": "colwise", "w3": "colwise",
        "w2": "rowwise", "tok_embeddings": "vocab-embedding", "output": "vocab-head"}


def test_tp_refuses_models_without_a_layout_and_indivisible_heads():
    # Its fused qkv is laid out [q | k | v], which the fx graph (layers called whole) cannot split by
    # heads, and it has no MLP: nothing left to shard.
    model = SkipModel()
    traced = trace_model(model, (torch.randint(0, 64, (2, 8)),))
    plan = make_plan("skip", model_fingerprint(model), traced.block_names, pp=1, tp=2)
    with pytest.raises(PartitionError, match="no tensor-parallel layout: .*fused q/k/v projection") as info:
        _check_tp_tracing(traced, check_model(model, plan))
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 10))
    with pytest.raises(PartitionError, match="no tensor-parallel layout: none of its 1 linear layers"):
        check_model(conv, make_plan("conv", model_fingerprint(conv), ("a",), pp=1, tp=2), (torch.randn(1, 3, 8, 8),))
    assert "\n" not in str(info.value)
    gqa = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=1,vocab_size=64,max_seq_len=16"
    with pytest.raises(PartitionError, match="num_kv_heads = 1"):
        check_model(zoo.build_model(gqa, device="meta"), _plan(gqa, pp=1, tp=2))
    with pytest.raises(PartitionError, match="num_heads = 4"):
        check_model(zoo.build_model(GPT, device="meta"), _plan(GPT, pp=1, tp=8))


# ---- checkpoints of tensor-parallel plans --------------------------------------------------------


def _train_and_save(rank, world_size, plan, directory):
    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime import partition

    pm = partition(plan.model, plan, device="cpu")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        ids, tgt = _data(plan.job.global_batch, seed=step)
        pm.step(ids, target=tgt)
        optimizer.step()
    ckpt.save_checkpoint(directory, 2, pm, optimizer)
    return True


def _restore_and_read(rank, world_size, plan, directory):
    from torch.distributed.tensor import DTensor

    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime import partition

    pm = partition(plan.model, plan, device="cpu", seed=5)  # other weights: the restore must replace them
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
    ckpt.restore(ckpt.load_checkpoint(directory), pm, optimizer, strict=True)

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    names = {id(p): n for n, p in pm.named_parameters()}
    return ({n: whole(p).clone() for n, p in pm.named_parameters()},
            {names[id(p)]: whole(s["exp_avg"]).clone() for p, s in optimizer.state.items()})


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_tensor_parallel_checkpoint_holds_shards_under_model_names_and_restores_under_another_tp(tmp_path):
    from autoplan.runtime.checkpoint import load_checkpoint

    saved_plan = _plan(GPT, pp=2, tp=2, sequence_parallel=True)
    run_ranks(_train_and_save, 4, saved_plan, str(tmp_path), timeout_s=100)
    ckpt = load_checkpoint(tmp_path)
    full = dict(zoo.build_model(GPT, device="meta").named_parameters())
    for name, p in full.items():  # the model's names and shapes, read whole in one process
        assert tuple(ckpt.params[name].shape) == tuple(p.shape), name
        assert tuple(ckpt.optimizer_state[name]["exp_avg"].shape) == tuple(p.shape), name
    # ... written as the tp ranks' shards (DCP chunks), never gathered: a column-parallel weight in two
    # halves, a row-parallel one too, a norm once. (A [q | k | v] fused projection, three chunks per
    # rank: test_checkpoint_dcp.py::test_a_fused_qkv_shard_saves_as_chunks_under_its_own_name_and_shape.)
    chunks = {k: len(md.chunks) for k, md in ckpt.metadata.state_dict_metadata.items() if hasattr(md, "chunks")}
    assert chunks["layers.0.mlp.fc1.weight"] == 2 and chunks["layers.0.attention.proj.weight"] == 2
    assert chunks["layers.0.attention_norm.weight"] == 1
    assert chunks["optimizer.state.layers.0.mlp.fc1.weight.exp_avg"] == 2
    for plan in (_plan(GPT, pp=4, tp=1), _plan(GPT, pp=1, tp=2, dp=2)):
        results = run_ranks(_restore_and_read, 4, plan, str(tmp_path), timeout_s=100)
        for params, exp_avgs in results.values():
            for name, value in params.items():
                torch.testing.assert_close(value, ckpt.lookup(name), rtol=0, atol=0)
            for name, value in exp_avgs.items():
                torch.testing.assert_close(value, ckpt.lookup(name, ckpt.optimizer_state)["exp_avg"], rtol=0, atol=0)
