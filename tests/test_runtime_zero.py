"""ZeRO-1 plans run with sharded optimizer state: the same training as a replicated optimizer, with
each dp replica holding only its share of the state (zero 2 / 3: tests/test_runtime_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from test_runtime_multiproc import GPT, _data
from test_runtime_precision import _plan_with

pytestmark = pytest.mark.multiproc

STEPS = 3


def _local(t):
    """This rank's values: a tensor-parallel DTensor's shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _train(rank, world_size, plans, checkpoint_root=None):
    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime import partition
    from autoplan.runtime.checkpoint import local_optimizer

    out = []
    for i, plan in enumerate(plans):
        pm = partition(GPT, plan, device="cpu")
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
        losses = []
        for step in range(STEPS):
            ids, tgt = _data(64, plan.job.global_batch, seed=step)
            loss = pm.step(ids, target=tgt)
            grads_held = sum(p.grad.numel() for p in pm.parameters() if p.grad is not None)
            optimizer.step()
            losses.append(None if loss is None else float(loss))
        state = local_optimizer(optimizer).state
        saved = None
        if checkpoint_root is not None:
            path = ckpt.save_checkpoint(f"{checkpoint_root}/{i}", STEPS, pm, optimizer)
            saved = str(path)
        out.append({
            "losses": losses,
            "params": {n: _local(p).detach().clone() for n, p in pm.named_parameters()},
            "state_numel": sum(_local(v).numel() for s in state.values() for k, v in s.items() if k == "exp_avg"),
            "param_numel": sum(_local(p).numel() for p in pm.parameters()),
            "grads_held": grads_held,
            "optimizer": type(optimizer).__name__,
            "checkpoint": saved,
        })
    return out


@pytest.mark.timeout(150)
def test_zero_1_trains_like_a_replicated_optimizer_with_sharded_state(tmp_path):
    """ZeRO-1 (runtime/parallel/optimizer.py); zero 2 and 3 are FSDP (tests/test_runtime_fsdp.py)."""
    plans = [_plan_with(GPT, 2, dp=2, zero=z) for z in (0, 1)]
    results = run_ranks(_train, 4, plans, str(tmp_path), timeout_s=140)
    for res in results.values():
        base, zero = res[0], res[1]
        assert zero["optimizer"] == "ZeroOneOptimizer"
        if base["losses"][0] is not None:  # ranks of the last stage
            assert zero["losses"] == pytest.approx(base["losses"], rel=1e-5)
        for name, value in base["params"].items():
            torch.testing.assert_close(zero["params"][name], value, rtol=1e-5, atol=1e-6)
    # Each replica of a stage holds a part of the optimizer state, together all of it once; every
    # replica keeps every gradient (ZeRO-1 shards only the optimizer state).
    for pp_index in (0, 1):
        ranks = [r for r in results if plans[1].coords(r)[0] == pp_index]
        shares = [results[r][1]["state_numel"] for r in ranks]
        assert sum(shares) == results[ranks[0]][1]["param_numel"] and all(0 < s < sum(shares) for s in shares)
        assert results[ranks[0]][0]["state_numel"] == results[ranks[0]][0]["param_numel"]
        assert [results[r][1]["grads_held"] for r in ranks] == [results[ranks[0]][1]["param_numel"]] * 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", [dict(pp=2, dp=2), dict(pp=1, tp=2, dp=2)], ids=["pp2-dp2", "tp2-dp2"])
def test_zero_checkpoint_holds_every_shard_and_restores_into_another_layout(tmp_path, layout):
    """With tp 2 each tp rank's dp group shards the state of its slices: the owners of a tensor's
    slices together write all of it (runtime/parallel/optimizer.py: owners by the global size)."""
    from autoplan.runtime.checkpoint import load_checkpoint

    layout = dict(layout)
    plan = _plan_with(GPT, layout.pop("pp"), zero=1, **layout)
    results = run_ranks(_train, 4, [plan], str(tmp_path), timeout_s=140)
    path = results[0][0]["checkpoint"]
    ckpt = load_checkpoint(path)
    # Every parameter has its full AdamW state in the checkpoint, from whichever replica owned it.
    model_params = {n for r in results.values() for n in r[0]["params"]}
    assert set(ckpt.optimizer_state) >= model_params
    assert set(ckpt.params) >= model_params
    for name in model_params:
        assert ckpt.optimizer_state[name]["exp_avg"].shape == ckpt.params[name].shape
    # ... and loads into a plan without ZeRO (2 ranks, replicated optimizer), every state found by name.
    other = _plan_with(GPT, 2, dp=1, zero=0)
    restored = run_ranks(_restore, 2, other, path, timeout_s=100)
    for rank, states in restored.items():
        assert states, f"rank {rank} restored nothing"
        for name, exp_avg in states.items():
            torch.testing.assert_close(exp_avg, ckpt.optimizer_state[name]["exp_avg"])


def _restore(rank, world_size, plan, path):
    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime import partition

    pm = partition(GPT, plan, device="cpu")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
    ckpt.restore(ckpt.load_checkpoint(path), pm, optimizer, strict=True)
    names = {id(p): n for n, p in pm.named_parameters()}
    torch.distributed.barrier()  # restore is not collective: rank 0's store stays up until all are done
    return {names[id(p)]: s["exp_avg"].clone() for p, s in optimizer.state.items()}


@pytest.mark.timeout(200)
def test_a_bf16_zero_1_checkpoint_takes_each_master_from_its_owner_and_restores_exactly(tmp_path):
    """bf16 tp 2 x dp 2: a rank holds the fp32 masters it owns only (runtime/parallel/precision.py
    `release_masters`), so each master's fp32 values in the checkpoint are its owner's; they equal a
    replicated optimizer's, and restore bit for bit into another layout with ZeRO-1 (the masters this
    rank owns there; the others' bf16 working copies are the saved values rounded) and without."""
    from autoplan.runtime.checkpoint import load_checkpoint

    plans = [_plan_with(GPT, 1, tp=2, dp=2, zero=z, dtype="bfloat16") for z in (0, 1)]
    results = run_ranks(_train, 4, plans, str(tmp_path), timeout_s=140)
    replicated, sharded = (load_checkpoint(results[0][i]["checkpoint"]) for i in (0, 1))
    assert set(sharded.params) == set(replicated.params)
    for name, value in replicated.params.items():
        assert sharded.params[name].dtype == value.dtype, name
        assert not sharded.params[name].isnan().any(), name  # no rank wrote a master it does not hold
        torch.testing.assert_close(sharded.params[name], value, rtol=1e-6, atol=1e-7)
    others = [_plan_with(GPT, 2, dp=2, zero=1, dtype="bfloat16"), _plan_with(GPT, 2, dp=2, zero=0, dtype="bfloat16")]
    restored = run_ranks(_restore_values, 4, others, results[0][1]["checkpoint"], timeout_s=120)
    for layout in (0, 1):
        held = [n for r in restored for n in restored[r][layout]["held"]]
        model = {n for r in restored for n in restored[r][layout]["values"]}
        if layout == 0:  # zero 1: each master held by one rank of its stage's dp group
            assert sorted(held) == sorted(model), layout
        else:  # zero 0: by every rank of its stage
            assert set(held) == model and len(held) == 2 * len(model), layout
        for r in restored:
            for name, value in restored[r][layout]["values"].items():
                expected = sharded.params[name]
                if name not in restored[r][layout]["held"]:
                    expected = expected.to(torch.bfloat16)
                assert value.dtype == expected.dtype and torch.equal(value, expected), (layout, r, name)
            for name, exp_avg in restored[r][layout]["exp_avg"].items():
                assert torch.equal(exp_avg, sharded.optimizer_state[name]["exp_avg"]), (layout, r, name)


def _restore_values(rank, world_size, plans, path):
    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime import partition

    out = []
    for plan in plans:
        pm = partition(GPT, plan, device="cpu", seed=1)
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
        ckpt.restore(ckpt.load_checkpoint(path), pm, optimizer, strict=True)
        names = {id(p): n for n, p in pm.named_parameters()}
        state = pm.state_dict()
        working = {n: w for s in pm.stages.values() for n, w in s.module.named_parameters()}
        held = [n for n, p in pm.named_parameters() if pm.holds_values(p)]
        for n in held:  # the working copies follow the masters this rank holds
            assert torch.equal(working[n], state[n].to(torch.bfloat16)), n
        out.append({"values": {n: state[n].clone() for n in names.values()}, "held": held,
                    "exp_avg": {names[id(p)]: s["exp_avg"].clone()
                                for p, s in ckpt.local_optimizer(optimizer).state.items()}})
        torch.distributed.barrier()
    return out
