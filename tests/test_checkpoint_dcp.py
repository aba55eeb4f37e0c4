"""Checkpoints through torch.distributed.checkpoint: a checkpoint saved under one plan restores
under other plans (pp, tp, dp, ZeRO level, one process) with every parameter and optimizer state
equal to the saved ones by name; export to one torch.save file; refusals before anything loads
(docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _dist import run_ranks
from test_runtime_multiproc import GPT, _data
from test_runtime_precision import _plan_with

from autoplan import models as zoo
from autoplan.runtime import checkpoint as ckpt

STEPS = 2
LR = 1e-2


def _whole(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()


def _state_by_name(pm, optimizer):
    """(params, optimizer states, lr of each parameter's group) of this rank, whole, by local name.
    Under ZeRO-1 the states of the parameters this replica steps; a tp shard is gathered (every tp
    rank calls this in the same order)."""
    from autoplan.runtime.checkpoint import local_optimizer

    names = {id(p): n for n, p in pm.named_parameters()}
    params = {n: _whole(p) for n, p in pm.named_parameters()}
    inner = local_optimizer(optimizer)
    states = {names[id(p)]: {k: _whole(v) for k, v in s.items()} for p, s in inner.state.items()}
    lrs = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    return params, states, lrs


def _train_and_save(rank, world_size, plans, root):
    from autoplan.runtime import partition

    out = []
    for i, plan in enumerate(plans):
        pm = partition(GPT, plan, device="cpu")
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR)
        for step in range(STEPS):
            ids, tgt = _data(64, plan.job.global_batch, seed=step)
            pm.step(ids, target=tgt)
            optimizer.step()
        path = ckpt.save_checkpoint(f"{root}/{i}", STEPS, pm, optimizer, extra={"note": f"plan {i}"})
        out.append((str(path), *_state_by_name(pm, optimizer)))
    return out


def _restore(rank, world_size, cases):
    """Restore each (plan, checkpoint) into a fresh partition (other initial weights, another lr)."""
    from autoplan.runtime import partition

    out = []
    for plan, path in cases:
        pm = partition(GPT, plan, device="cpu", seed=99)
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR / 2)
        step = ckpt.restore(ckpt.load_checkpoint(path), pm, optimizer, strict=True)
        if pm.precision is not None:  # bf16: the working copies follow the restored fp32 masters
            for stage in pm.stages.values():
                for p in stage.params:
                    assert torch.equal(p, pm.precision.master_of[id(p)].to(p.dtype))
        out.append((step, *_state_by_name(pm, optimizer)))
    _barrier()
    return out


def _barrier():
    """`restore` is not collective: keep every rank (and rank 0's store) up until all are done."""
    import torch.distributed as dist

    dist.barrier()


def _merged(saved_runs):
    """The saved ranks' params, optimizer states and lrs merged by name (replicas agree bitwise)."""
    params, states, lrs = {}, {}, {}
    for _, p, s, lr in saved_runs:
        params.update(p)
        states.update(s)
        lrs.update(lr)
    return params, states, lrs


TIED = {"output.weight": "tok_embeddings.weight"}


def _assert_same(restored_runs, saved, *, what):
    params, states, lrs = saved
    seen_params, seen_states = set(), set()
    for step, p, s, lr in restored_runs:
        assert step == STEPS, what
        for name, value in p.items():
            ref = params.get(name, params.get(TIED.get(name, name)))
            assert torch.equal(value, ref), (what, name)
            seen_params.add(name)
        for name, state in s.items():
            ref = states.get(name) or states[TIED.get(name, name)]
            assert state.keys() == ref.keys(), (what, name)
            assert all(torch.equal(state[k], ref[k]) for k in state), (what, name)
            seen_states.add(name)
        assert set(lr.values()) == {LR}, (what, lr)  # hyperparameters restored by name, not the new lr
    model_names = {n for n, _ in zoo.build_model(GPT, device="meta").named_parameters()}
    assert model_names <= seen_params | set(TIED.values()), (what, model_names - seen_params)
    assert model_names <= seen_states | set(TIED.values()), (what, model_names - seen_states)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps under (pp 2, dp 2) with a replicated optimizer (checkpoint 0), with ZeRO-1
    (checkpoint 1) and in bf16 (checkpoint 2), each saved; what every rank held, by name."""
    root = tmp_path_factory.mktemp("dcp")
    plans = [_plan_with(GPT, 2, dp=2, zero=0), _plan_with(GPT, 2, dp=2, zero=1),
             _plan_with(GPT, 2, dp=2, dtype="bfloat16")]
    results = run_ranks(_train_and_save, 4, plans, str(root), timeout_s=120)
    paths = [results[0][i][0] for i in range(len(plans))]
    return paths, [_merged([results[r][i] for r in results]) for i in range(len(plans))]


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_pp2_dp2_checkpoint_restores_under_pp4_tp2_pp2_and_one_process(saved):
    """Every restored parameter and optimizer state equals the saved one by name, bit for bit."""
    paths, states = saved
    cases = [(_plan_with(GPT, 4), paths[0]), (_plan_with(GPT, 2, tp=2), paths[0]),
             (_plan_with(GPT, 4, dtype="bfloat16"), paths[2])]
    restored = run_ranks(_restore, 4, cases, timeout_s=120)
    _assert_same([restored[r][0] for r in restored], states[0], what="pp 4")
    _assert_same([restored[r][1] for r in restored], states[0], what="tp 2, pp 2")
    _assert_same([restored[r][2] for r in restored], states[2], what="bf16: fp32 masters, pp 2 -> pp 4")
    single = run_ranks(_restore, 1, [(_plan_with(GPT, 1), paths[0])], timeout_s=60)
    _assert_same([single[0][0]], states[0], what="one process")


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_zero1_checkpoint_restores_without_zero_and_back(saved):
    paths, states = saved
    # ZeRO-1 -> replicated optimizer: every replica gets every state, whichever replica owned it.
    # Replicated -> ZeRO-1: each replica gets the states of the parameters it steps.
    cases = [(_plan_with(GPT, 2, dp=2, zero=0), paths[1]), (_plan_with(GPT, 2, dp=2, zero=1), paths[0])]
    restored = run_ranks(_restore, 4, cases, timeout_s=120)
    _assert_same([restored[r][0] for r in restored], states[1], what="zero 1 -> zero 0")
    _assert_same([restored[r][1] for r in restored], states[0], what="zero 0 -> zero 1")
    for r in restored:  # ZeRO-1 replicas hold disjoint shares of the optimizer state
        assert 0 < len(restored[r][1][2]) < len(restored[r][0][2]), r


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_zero3_checkpoint_restores_under_pp4_tp2_pp2_and_one_process(tmp_path):
    """The issue's case: save under (pp 2, dp 2, ZeRO-3: FSDP2 shards), restore under (pp 4),
    (tp 2, pp 2) and one process: identical parameters and optimizer state by name."""
    results = run_ranks(_train_and_save, 4, [_plan_with(GPT, 2, dp=2, zero=3)], str(tmp_path), timeout_s=120)
    path = results[0][0][0]
    states = _merged([results[r][0] for r in results])
    meta = ckpt.load_checkpoint(path).metadata.state_dict_metadata
    assert len(meta["layers.0.mlp.fc1.weight"].chunks) == 2  # FSDP's dp shards, as shards
    assert len(meta["optimizer.state.layers.0.mlp.fc1.weight.exp_avg"].chunks) == 2
    cases = [(_plan_with(GPT, 4), path), (_plan_with(GPT, 2, tp=2), path)]
    restored = run_ranks(_restore, 4, cases, timeout_s=120)
    _assert_same([restored[r][0] for r in restored], states, what="zero 3 -> pp 4")
    _assert_same([restored[r][1] for r in restored], states, what="zero 3 -> tp 2, pp 2")
    single = run_ranks(_restore, 1, [(_plan_with(GPT, 1), path)], timeout_s=60)
    _assert_same([single[0][0]], states, what="zero 3 -> one process")


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_hsdp_and_fsdp_with_tp_checkpoints_restore_under_other_layouts(tmp_path):
    """HSDP (FSDP shards in groups of 2, replicated across) and FSDP x tp (2-D DTensors) save as
    shards; they restore into pp 4 and into (pp 2, dp 2, ZeRO-3), and ZeRO-3 into HSDP."""
    plans = [_plan_with(GPT, 1, dp=4, zero=3, dp_replicate=2), _plan_with(GPT, 1, dp=2, tp=2, zero=3)]
    results = run_ranks(_train_and_save, 4, plans, str(tmp_path), timeout_s=120)
    paths = [results[0][i][0] for i in range(len(plans))]
    states = [_merged([results[r][i] for r in results]) for i in range(len(plans))]
    meta = ckpt.load_checkpoint(paths[0]).metadata.state_dict_metadata
    assert len(meta["layers.0.mlp.fc1.weight"].chunks) == 2  # dp_shard 2: two shards, each written once
    meta = ckpt.load_checkpoint(paths[1]).metadata.state_dict_metadata
    assert len(meta["layers.0.mlp.fc1.weight"].chunks) == 4  # 2 (dp) x 2 (tp) shards
    cases = [(_plan_with(GPT, 4), paths[0]), (_plan_with(GPT, 2, dp=2, zero=3), paths[1]),
             (_plan_with(GPT, 1, dp=4, zero=3, dp_replicate=2), paths[1])]
    restored = run_ranks(_restore, 4, cases, timeout_s=120)
    _assert_same([restored[r][0] for r in restored], states[0], what="hsdp -> pp 4")
    _assert_same([restored[r][1] for r in restored], states[1], what="fsdp x tp -> pp 2, dp 2, zero 3")
    _assert_same([restored[r][2] for r in restored], states[1], what="fsdp x tp -> hsdp")


GPT2 = "hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"


def _strided_save_and_restore(rank, world_size, plan, root):
    """Train a step of GPT-2 under tp 2, save, restore into a fresh partition; return the whole
    tensors as saved and the c_attn weight's placement."""
    from autoplan.runtime import partition
    from autoplan.runtime.launcher.training import _batch_fn

    pm = partition(GPT2, plan, device="cpu")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR)
    pm.step(*_batch_fn(pm, None, plan, 0)(0)[0], target=_batch_fn(pm, None, plan, 0)(0)[1])
    optimizer.step()
    path = ckpt.save_checkpoint(root, 1, pm, optimizer)
    params, states, _ = _state_by_name(pm, optimizer)
    fresh = partition(GPT2, plan, device="cpu", seed=99)
    fresh_opt = fresh.make_optimizer(torch.optim.AdamW, lr=LR)
    ckpt.restore(ckpt.load_checkpoint(path), fresh, fresh_opt)
    local = {n: p.to_local() for n, p in pm.named_parameters()}
    for n, p in fresh.named_parameters():  # this rank's shard, read back box by box
        assert torch.equal(p.to_local(), local[n]), n
    weight = dict(pm.named_parameters())["transformer.h.0.attn.c_attn.weight"]
    _barrier()
    return str(path), str(weight.placements), params, states


@pytest.mark.hf
@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_a_fused_qkv_shard_saves_as_chunks_under_its_own_name_and_shape(tmp_path):
    """GPT-2's c_attn under tp 2 holds [q_r | k_r | v_r] (`_StridedShard`, [Note: strided shards in
    DCP]): saved as 3 chunks per rank, read whole in one process and back into tp shards."""
    pytest.importorskip("transformers")
    import autoplan

    plan = autoplan.suggest(GPT2, "1x2xcpu", global_batch=4, seq_len=16, tp=2, pp=1, dtype="fp32",
                            micro_batch_size=1)[0]
    results = run_ranks(_strided_save_and_restore, 2, plan, str(tmp_path), timeout_s=140)
    path, placement, params, states = results[0]
    assert "_StridedShard" in placement, placement
    loaded = ckpt.load_checkpoint(path)
    assert len(loaded.metadata.state_dict_metadata["transformer.h.0.attn.c_attn.weight"].chunks) == 6
    for name, value in params.items():
        assert torch.equal(loaded.lookup(name), value), name
    for name, state in states.items():
        assert torch.equal(loaded.lookup(name, loaded.optimizer_state)["exp_avg"], state["exp_avg"]), name


# ---- one process: plain model, export, refusals ---------------------------------------------------


@pytest.mark.multiproc
def test_plain_model_export_and_per_rank_extras(saved, tmp_path):
    paths, states = saved
    params, opt_states, _ = states[0]
    full = ckpt.load_full_state_dict(paths[0])  # no process group
    model = zoo.build_model(GPT, device="cpu", seed=7)
    model.load_state_dict(full, strict=True)  # tied aliases filled in
    assert all(torch.equal(t, params.get(n, params.get(TIED.get(n, n)))) for n, t in model.state_dict().items())
    # Export: the model's state dict in one torch.save file, or everything DCP holds.
    out = ckpt.export_torch_save(paths[0], tmp_path / "model.pt")
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    everything = torch.load(ckpt.export_torch_save(paths[0], tmp_path / "all.pt", model_only=False), weights_only=False)
    assert torch.equal(everything["optimizer"]["state"]["layers.0.mlp.fc1.weight"]["exp_avg"],
                       opt_states["layers.0.mlp.fc1.weight"]["exp_avg"])
    # Per-rank extras: every rank's RNG state and `extra`; the manifest records the layout.
    loaded = ckpt.load_checkpoint(paths[0])
    assert sorted(loaded.rank_state) == [0, 1, 2, 3]
    assert all(s["extra"] == {"step": STEPS, "note": "plan 0"} for s in loaded.rank_state.values())
    assert all(s["rng"]["torch"].dtype == torch.uint8 for s in loaded.rank_state.values())
    assert loaded.manifest["format"] == "autoplan-checkpoint/2" and loaded.manifest["layout"]["pp"] == 2
    assert loaded.hyperparameters["layers.0.mlp.fc1.weight"]["lr"] == LR
    # Replicated tensors are written once (one chunk), by one of the replicas.
    assert all(len(md.chunks) == 1 for k, md in loaded.metadata.state_dict_metadata.items() if hasattr(md, "chunks"))


@pytest.mark.multiproc
def test_export_from_the_command_line(saved, tmp_path):
    paths, _ = saved
    out = tmp_path / "m.pt"
    proc = subprocess.run([sys.executable, "-m", "autoplan", "export-checkpoint", str(paths[0]), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr
    names = {n for n, _ in zoo.build_model(GPT, device="meta").named_parameters()}
    assert set(torch.load(out, weights_only=True)) >= names
    bad = subprocess.run([sys.executable, "-m", "autoplan", "export-checkpoint", str(tmp_path / "none"), "--out",
                          str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


class _FakePlan:
    def __init__(self, fingerprint):
        self.model_fingerprint = fingerprint


class _FakePM:
    """The public surface of PartitionedModel that checkpoints use."""

    def __init__(self, params, fingerprint=None):
        self.params = params
        self.aliases = {}
        if fingerprint is not None:
            self.plan = _FakePlan(fingerprint)

    def named_parameters(self):
        return iter(self.params.items())

    def state_dict(self):
        return {n: p.detach() for n, p in self.params.items()}


def test_a_checkpoint_of_another_model_or_a_corrupt_one_is_refused_in_one_line_before_loading(tmp_path):
    params = {"w": torch.nn.Parameter(torch.randn(4, 4))}
    pm = _FakePM(params)
    path = ckpt.save_checkpoint(tmp_path, 1, pm)
    manifest = ckpt.load_checkpoint(path).manifest
    assert manifest["model_fingerprint"] is None  # a pm without a plan: no fingerprint to check

    def refused(target, match):
        before = {n: p.detach().clone() for n, p in target.params.items()}
        with pytest.raises(ckpt.CheckpointError, match=match) as info:
            ckpt.restore(ckpt.load_checkpoint(path), target)
        assert "\n" not in str(info.value)
        assert all(torch.equal(before[n], p) for n, p in target.params.items())  # nothing loaded

    refused(_FakePM({"w": torch.nn.Parameter(torch.zeros(4, 5))}), "shape")
    refused(_FakePM({"v": torch.nn.Parameter(torch.zeros(4, 4))}), "no entry for 1 parameters")
    # The manifest's fingerprint against the plan's.
    (path / "manifest.json").write_text(json.dumps({**manifest, "model_fingerprint": "abc", "model": "gpt:x"}))
    refused(_FakePM({"w": torch.nn.Parameter(torch.zeros(4, 4))}, fingerprint="def"), "fingerprint abc")
    # A data file of the recorded size but garbage inside: the manifest says complete, the load fails.
    data = path / "__0_0.distcp"
    data.write_bytes(b"\0" * data.stat().st_size)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint") as info:
        ckpt.restore(ckpt.load_checkpoint(path), _FakePM({"w": torch.nn.Parameter(torch.zeros(4, 4))}))
    assert "\n" not in str(info.value)
