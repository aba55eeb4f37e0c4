"""The runtime runs a plan's recompute and dtype as planned: recomputation (full, selective) and
bf16 mixed precision with fp32 masters, on gloo ranks against single-process references."""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import make_plan, recorded_sends, run_ranks
from test_runtime_multiproc import GPT, LLAMA, _build, _data, _plan

from autoplan import models as zoo
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import trace_model

pytestmark = pytest.mark.multiproc


def _plan_with(kind, pp, **kwargs):
    base = _plan(kind, pp)
    return make_plan(kind, base.model_fingerprint, base.block_names, pp=pp, **kwargs)


def _run(rank, world_size, cases):
    from autoplan.runtime import partition

    out = []
    for kind, plan in cases:
        model, loss_fn, vocab = _build(kind)
        ids, tgt = _data(vocab, plan.job.global_batch)
        with recorded_sends() as sent:
            pm = partition(model, plan, example_inputs=(ids[:1],), loss_fn=loss_fn, example_target=tgt[:1],
                           device="cpu")
            loss = pm.step(ids, target=tgt)
        sent_dtypes = {str(t.dtype) for t in sent}
        out.append({
            "loss": None if loss is None else float(loss),
            "grads": {n: p.grad.clone() for n, p in pm.named_parameters()},
            "param_dtypes": {str(p.dtype) for _, p in pm.named_parameters()},
            "working_dtypes": {str(p.dtype) for s in pm.stages.values() for p in s.params},
            "sent_dtypes": sent_dtypes,
            "recomputed": sorted(b for s in pm.stages.values() if s.runner for b in s.runner.recomputed_blocks),
        })
    return out


def _reference(kind, plan, dtype=torch.float32):
    """Loss and fp32 gradients of the same micro-batches on one process; in bf16 the model computes
    in bf16 and each micro-batch's gradient is added to an fp32 sum (the runtime's semantics)."""
    model, loss_fn, vocab = _build(kind)
    if kind not in ("skip", "hf"):
        model = zoo.build_model(kind, device="cpu", seed=0)
    model = copy.deepcopy(model).to(dtype)
    ids, tgt = _data(vocab, plan.job.global_batch)
    chunks = plan.dp * plan.num_microbatches
    total, grads = 0.0, {}
    for a, b in zip(ids.chunk(chunks), tgt.chunk(chunks)):
        loss = loss_fn(model(a), b) / chunks
        loss.backward()
        total += loss.item()
        for n, p in model.named_parameters(remove_duplicate=False):
            grads[n] = grads.get(n, 0) + p.grad.float()
        model.zero_grad()
    return total, grads


def _compare(kind, plan, results, index, *, rtol, atol):
    ref_loss, ref_grads = _reference(kind, plan, torch.bfloat16 if plan.job.dtype == "bfloat16" else torch.float32)
    losses = [r[index]["loss"] for r in results.values() if r[index]["loss"] is not None]
    assert losses and all(loss == pytest.approx(ref_loss, rel=rtol) for loss in losses), (losses, ref_loss)
    names = set()
    for rank, rank_results in results.items():
        for name, grad in rank_results[index]["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=rtol, atol=atol,
                                       msg=lambda m, n=name, r=rank: f"{kind} {plan.recompute} rank {r} {n}: {m}")
            names.add(name)
    assert names, "no gradients compared"


@pytest.mark.timeout(150)
def test_recompute_full_and_selective_give_the_same_gradients_as_none():
    cases = [(GPT, _plan_with(GPT, 2, recompute="full")), (GPT, _plan_with(GPT, 2, recompute="selective")),
             (LLAMA, _plan_with(LLAMA, 2, recompute="full", schedule="zb-h1")),
             ("skip", _plan_with("skip", 2, recompute="full", cuts=(2, 7)))]
    results = run_ranks(_run, 2, cases, timeout_s=140)
    for i, (kind, plan) in enumerate(cases):
        _compare(kind, plan, results, i, rtol=1e-5, atol=1e-6)
    # Every transformer layer of the gpt (blocks 1..4) was checkpointed, on whichever rank holds it.
    assert sorted(b for r in results.values() for b in r[0]["recomputed"]) == [1, 2, 3, 4]
    assert sorted(b for r in results.values() for b in r[1]["recomputed"]) == [1, 2, 3, 4]


@pytest.mark.timeout(150)
def test_bf16_plan_runs_bf16_compute_with_fp32_masters():
    cases = [(GPT, _plan_with(GPT, 2, dtype="bfloat16")),
             (LLAMA, _plan_with(LLAMA, 2, dtype="bfloat16", schedule="zb-h1")),
             (GPT, _plan_with(GPT, 2, dtype="bfloat16", recompute="full", schedule="gpipe"))]
    results = run_ranks(_run, 2, cases, timeout_s=140)
    for i, (kind, plan) in enumerate(cases):
        # The same bf16 ops in the same order; tied copies and stage boundaries add bf16 roundings.
        _compare(kind, plan, results, i, rtol=2e-2, atol=2e-3)
        for r in results.values():
            assert r[i]["param_dtypes"] == {"torch.float32"}  # what the optimizer steps and checkpoints hold
            assert r[i]["working_dtypes"] == {"torch.bfloat16"}
        assert set().union(*(r[i]["sent_dtypes"] for r in results.values())) == {"torch.bfloat16"}


def _saved_bytes(rank, world_size, plans):
    """Bytes saved for backward during one training step, parameters excluded, per plan."""
    from autoplan.runtime import partition

    out = []
    for plan in plans:
        pm = partition(GPT, plan, device="cpu")
        params = {p.data_ptr() for s in pm.stages.values() for p in s.params}
        seen: dict[int, int] = {}

        def pack(t, _params=params, _seen=seen):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in _params:
                _seen[ptr] = max(_seen.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        ids, tgt = _data(64, plan.job.global_batch)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pm.step(ids, target=tgt)
        out.append(sum(seen.values()))
    return out


@pytest.mark.timeout(120)
def test_full_recompute_keeps_only_layer_inputs():
    model = zoo.build_model(GPT, device="meta")
    traced = trace_model(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    plans = [make_plan(GPT, model_fingerprint(model), traced.block_names, pp=1, num_microbatches=1, recompute=r)
             for r in ("none", "selective", "full")]
    none, selective, full = run_ranks(_saved_bytes, 1, plans, timeout_s=110)[0]
    assert selective <= none
    # Full recompute keeps each of the 4 layers' input (2 x 16 x 32 fp32 = 4 KiB) instead of its
    # activations: at least 4 layers x (their saved bytes - 4 KiB) less.
    profile = __import__("autoplan").profile(GPT, batch_size=2, seq_len=16, dtype="fp32")
    layer_saved = [b.saved_bytes for b in profile.blocks if b.kind == "layer"]
    assert len(layer_saved) == 4
    expected_drop = sum(s - 2 * 16 * 32 * 4 for s in layer_saved)
    assert none - full == pytest.approx(expected_drop, rel=0.15), (none, full, expected_drop)
