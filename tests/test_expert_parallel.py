"""Expert parallelism through the public API: plans from `autoplan.suggest` with `ep` pinned, run
by `autoplan.partition(...).step` on 4 gloo ranks, against a single-process reference of the whole
model (loss with the load-balancing term, and every gradient, experts' slices put back together)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
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
    # FSDP under tp: the ep group folded over tp x dp, the experts sharded over the 2 ranks holding them
    "ep2-tp2-zero3": dict(tp=2, pp=1, dp=2, ep=2, zero=3),
    # HSDP: the experts sharded within each replica group of 2 and replicated across the 2 groups
    "ep2-hsdp": dict(tp=1, pp=1, dp=4, ep=2, zero=3, dp_replicate=2),
    # ep beyond dp: 4 ranks of tp 2 x dp 2, one expert each (Megatron-Core's EP = TP x DP)
    "ep4-tp2": dict(tp=2, pp=1, dp=2, ep=4),
}


def step_and_collect(pm, rank: int) -> dict:
    """One step of `pm` on the source's batch: the loss, and the gradients (the experts' slices by ep
    index from every rank, the rest from dp rank 0), whole (collective for tp shards)."""
    plan, template = pm.plan, pm.output_template
    inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    loss = pm.step(*inputs, target=target)
    experts = {id(p) for p in pm.expert_params}
    grads, slices = {}, {}
    whole = [(n, p, _full(p.grad)) for n, p in pm.named_parameters()]  # collective for tp shards
    for n, p, g in whole:  # every rank's expert slice (plan.py [Note: expert layout]), checked to agree
        if id(p) in experts:
            slices[n] = (pm.layout.ep_index, g)
        elif pm.layout.dp_index == 0 and pm.layout.tp_index == 0:
            grads[n] = g
    layout = pm.layout
    groups = {kind: dist.get_process_group_ranks(group) if group is not None else None
              for kind, group in (("ep", layout.ep_group), ("replicas", layout.expert_dp_group))}
    mesh = layout.expert_fsdp_mesh
    placements = [str(p.placements) for p in pm.expert_params if hasattr(p, "placements")]
    return dict(loss=None if loss is None else float(loss), grads=grads, slices=slices,
                batch=(inputs, target) if rank == 0 else None, groups=groups,
                where=(layout.pp_index, layout.dp_index, layout.tp_index, layout.ep_index),
                expert_mesh=None if mesh is None else tuple(mesh.mesh.shape), expert_placements=placements)


def reference_and_slices(spec: str, name: str, plan, results: dict):
    """(reference model, its gradients, the dense gradients of the ranks, the experts' slices by their
    key) of layout `name`, each rank's results as `step_and_collect` gives them, the loss checked
    against a single process (tests/test_user_paths.py `_reference`) and the copies of a slice
    (ranks holding the same one) checked to agree."""
    inputs, target = results[0][name]["batch"]
    model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
    losses = [r[name]["loss"] for r in results.values() if r[name]["loss"] is not None]
    assert losses and all(loss == pytest.approx(ref_loss, rel=1e-5) for loss in losses), (name, losses, ref_loss)
    grads = {}
    for r in results.values():
        grads.update(r[name]["grads"])
    pieces: dict[str, dict] = {}
    for r in results.values():
        for n, (key, g) in r[name]["slices"].items():
            if key in pieces.get(n, {}):  # the ranks holding the same slice end with the same gradient
                torch.testing.assert_close(g, pieces[n][key], msg=lambda m, n=n: f"{name}: copies of {n}: {m}")
            pieces.setdefault(n, {})[key] = g
    assert pieces, f"{name}: no expert parameters were split"
    return model, ref_grads, grads, pieces


def check_against_reference(spec: str, name: str, plan, results: dict) -> None:
    """The loss and every gradient of layout `name` (`step_and_collect` on every rank) against a
    single process, the experts' slices put back together (`reference_and_slices`)."""
    _, ref_grads, grads, pieces = reference_and_slices(spec, name, plan, results)
    _check_expert_layout(name, plan, results)
    for n, parts in pieces.items():
        assert sorted(parts) == list(range(plan.ep)), (name, n, sorted(parts))
        grads[n] = torch.cat([parts[i] for i in range(plan.ep)])
    assert set(grads) == set(ref_grads), (name, set(ref_grads) ^ set(grads))
    rtol = 1e-4 if plan.tp > 1 else 1e-5
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=rtol * scale, msg=lambda m, n=n, name=name: f"{name}: {n}: {m}")


def _check_expert_layout(name: str, plan, results: dict) -> None:
    """The groups each rank made are the plan's expert layout (plan.py [Note: expert layout]): under
    expert tp 1 with tp > 1 the ep group is ep consecutive ranks over tp x dp (Megatron-Core's MoE
    parallel folding), a rank's experts its position mod ep, and the ranks holding the same experts
    tp * dp / ep of them (at tp 1 the positions are the dp replicas)."""
    assert plan.rank_order == "tp-dp-pp", plan.rank_order  # the positions are then consecutive ranks
    for rank, r in results.items():
        pp_index, dp_index, tp_index, ep_index = r[name]["where"]
        assert ep_index == (dp_index * plan.tp + tp_index) % plan.ep, (name, rank, r[name]["where"])
        ep_ranks = r[name]["groups"]["ep"]
        # consecutive ranks, this one at its ep index (the all-to-all sends part j to group rank j)
        assert ep_ranks == list(range(ep_ranks[0], ep_ranks[0] + plan.ep)), (name, rank, ep_ranks)
        assert ep_ranks.index(rank) == ep_index, (name, rank, ep_ranks)
        replicas = r[name]["groups"]["replicas"]
        size = plan.tp * plan.dp // plan.ep
        assert (replicas is None and size == 1) or len(replicas) == size, (name, rank, replicas)
        assert all(results[q][name]["where"][3] == ep_index for q in replicas or ()), (name, rank, replicas)


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


CP_SPEC = SPEC.replace("num_shared_experts=1", "num_shared_experts=1,capacity_factor=2")
"""The model with a capacity that drops nothing (num_experts / experts_per_token): each cp rank routes
its own chunks with the capacity of its tokens, and no token is dropped either way."""
CP_LAYOUTS = {
    "cp2-ep2": (CP_SPEC, dict(tp=1, pp=1, dp=4, cp=2, ep=2)),
    "cp2-tp2-ep2-dropless": (CP_SPEC.replace("capacity_factor=2", "dropless=true"), dict(tp=2, pp=1, dp=2, cp=2, ep=2)),
}


def _cp_rank_job(rank: int, world_size: int, plans: dict) -> dict:
    return {name: step_and_collect(autoplan.partition(CP_LAYOUTS[name][0], plan, device="cpu"), rank)
            for name, plan in plans.items()}


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_context_parallelism_with_expert_parallelism_matches_a_single_process():
    """cp 2 with ep 2: the cp ranks' chunks are tokens of their own to the experts, so the ep group
    folds over them as over tp and dp (plan.py [Note: expert layout]); the balance loss sums its
    counts over the cp group (graph/positions.py). With capacity routing that drops nothing, and
    dropless under tp 2."""
    plans = {name: autoplan.suggest(spec, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32",
                                    micro_batch_size=MICRO_BATCH, top=1, **pins)[0]
             for name, (spec, pins) in CP_LAYOUTS.items()}
    assert all((plan.cp, plan.ep) == (2, 2) for plan in plans.values())
    results = run_ranks(_cp_rank_job, 4, plans, timeout_s=350, pg_timeout_s=120)
    for name, plan in plans.items():
        check_against_reference(CP_LAYOUTS[name][0], name, plan, results)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_hsdp_with_ep_on_8_ranks_shards_the_experts_inside_each_replica_group():
    """dp 8 as 2 replica groups of 4, ep 2: the ranks holding the same experts are a (2 replicas, 2
    shards) grid (plan.py [Note: expert layout]), over which FSDP shards and replicates them (on 4
    ranks the shard axis is one rank)."""
    plan = autoplan.suggest(SPEC, "1x8xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32",
                            micro_batch_size=1, top=1, tp=1, pp=1, dp=8, ep=2, zero=3, dp_replicate=2)[0]
    assert (plan.dp, plan.dp_replicate, plan.ep, plan.zero) == (8, 2, 2, 3)
    results = run_ranks(_rank_job, 8, {"ep2-hsdp-8": plan}, timeout_s=250, pg_timeout_s=120)
    check_against_reference(SPEC, "ep2-hsdp-8", plan, results)
    for r in results.values():  # 2 replica groups x 2 shards, the experts replicated and sharded on it
        assert r["ep2-hsdp-8"]["expert_mesh"] == (2, 2), r["ep2-hsdp-8"]["expert_mesh"]
        placements = r["ep2-hsdp-8"]["expert_placements"]
        assert placements and set(placements) == {"(Replicate(), Shard(dim=0))"}, placements
