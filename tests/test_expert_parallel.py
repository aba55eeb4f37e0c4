"""Expert parallelism through the public API: plans from `autoplan.suggest` with `ep` pinned, run
by `autoplan.partition(...).step` on 4 gloo ranks, against a single-process reference of the whole
model (loss with the load-balancing term, and every gradient, experts' slices put back together)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH, _full, _reference

import autoplan

SPEC = ("moe:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=96,vocab_size=256,max_seq_len=64,"
        "num_experts=4,experts_per_token=2,num_shared_experts=1")
SEQ_LEN = 32
LAYOUTS = {
    "ep2-dp4": dict(tp=1, pp=1, dp=4, ep=2),          # two ep groups: expert gradients summed across them
    "ep2-pp2": dict(tp=1, pp=2, dp=2, ep=2, schedule="1f1b"),
    "ep4": dict(tp=1, pp=1, dp=4, ep=4),              # one expert per rank
    "ep2-tp2": dict(tp=2, pp=1, dp=2, ep=2),
    "ep2-pp2-zb": dict(tp=1, pp=2, dp=2, ep=2, schedule="zb-h1"),
    # FSDP: experts sharded over the replicas holding the same experts (2 of them, then 1)
    "ep2-dp4-zero3": dict(tp=1, pp=1, dp=4, ep=2, zero=3),
    "ep4-zero2": dict(tp=1, pp=1, dp=4, ep=4, zero=2),
    "ep2-pp2-zero3": dict(tp=1, pp=2, dp=2, ep=2, zero=3, schedule="1f1b"),
}


def step_and_collect(pm, rank: int) -> dict:
    """One step of `pm` on the source's batch: the loss, and the gradients one ep group holds (the
    experts' slices by ep index, the rest from dp rank 0), whole (collective for tp shards)."""
    plan, template = pm.plan, pm.output_template
    inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    loss = pm.step(*inputs, target=target)
    experts = {id(p) for p in pm.expert_params}
    grads, slices = {}, {}
    whole = [(n, p, _full(p.grad)) for n, p in pm.named_parameters()]  # collective for tp shards
    if pm.layout.tp_index == 0 and pm.layout.dp_index < plan.ep:  # one ep group holds every expert once
        for n, p, g in whole:
            if id(p) in experts:
                slices[n] = (pm.layout.ep_index, g)
            elif pm.layout.dp_index == 0:
                grads[n] = g
    return dict(loss=None if loss is None else float(loss), grads=grads, slices=slices,
                batch=(inputs, target) if rank == 0 else None)


def check_against_reference(spec: str, name: str, plan, results: dict) -> None:
    """The loss and every gradient of layout `name` (`step_and_collect` on every rank) against a
    single process (tests/test_user_paths.py `_reference`), the experts' slices put back together."""
    inputs, target = results[0][name]["batch"]
    model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
    losses = [r[name]["loss"] for r in results.values() if r[name]["loss"] is not None]
    assert losses and all(loss == pytest.approx(ref_loss, rel=1e-5) for loss in losses), (name, losses, ref_loss)
    grads = {}
    for r in results.values():
        grads.update(r[name]["grads"])
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for r in results.values():
        for n, (index, g) in r[name]["slices"].items():
            pieces.setdefault(n, {})[index] = g
    assert pieces, f"{name}: no expert parameters were split"
    for n, parts in pieces.items():
        assert sorted(parts) == list(range(plan.ep)), (name, n, sorted(parts))
        grads[n] = torch.cat([parts[i] for i in range(plan.ep)])
    assert set(grads) == set(ref_grads), (name, set(ref_grads) ^ set(grads))
    rtol = 1e-4 if plan.tp > 1 else 1e-5
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=rtol * scale, msg=lambda m, n=n, name=name: f"{name}: {n}: {m}")


def _rank_job(rank: int, world_size: int, plans: dict) -> dict:
    return {name: step_and_collect(autoplan.partition(SPEC, plan, device="cpu"), rank) for name, plan in plans.items()}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_expert_parallel_matches_a_single_process_reference():
    plans = {name: autoplan.suggest(SPEC, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32",
                                    micro_batch_size=MICRO_BATCH, top=1, **pins)[0] for name, pins in LAYOUTS.items()}
    for name, plan in plans.items():
        assert plan.ep == LAYOUTS[name]["ep"], name  # the zero level is the search's where not pinned (0 or 1)
        assert plan.zero == LAYOUTS[name]["zero"] if "zero" in LAYOUTS[name] else plan.zero in (0, 1), name
    results = run_ranks(_rank_job, 4, plans, timeout_s=500, pg_timeout_s=120)
    for name, plan in plans.items():
        check_against_reference(SPEC, name, plan, results)
