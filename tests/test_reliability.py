"""Reliability of `autoplan run`: exact resume from checkpoints, crash-safe checkpoint writes,
resharding a checkpoint between plans, and no hangs when a rank dies or hangs (docs/reliability.md).

Multi-rank runs use the launcher (`run_plan`) with a forkserver that has torch preloaded, so each
run costs about a second and a half instead of a fresh interpreter per rank.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import time
from pathlib import Path

import pytest
import torch
from _dist import make_plan, run_ranks
from conftest import scaled_timeout_s

from autoplan import models as zoo
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import trace_model
from autoplan.runtime import checkpoint as ckpt
from autoplan.runtime import run_plan
from autoplan.runtime.launcher.launch import FORKSERVER_PRELOAD
from autoplan.runtime.launcher.training import synthetic_batch

pytestmark = pytest.mark.multiproc

GPT = "gpt:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
FAST = dict(_start_method="forkserver", timeout_s=10)


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    """Start the forkserver with torch and the runtime imported (no-op if one already runs)."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()


def _plan(pp: int, dp: int = 1, cuts=None, zero: int = 0):
    model = zoo.build_model(GPT, device="meta")
    traced = trace_model(model, (torch.zeros(2, 16, dtype=torch.long),))
    return make_plan(GPT, model_fingerprint(model), traced.block_names, pp=pp, dp=dp, cuts=cuts, zero=zero)


def _losses(path: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps of pp=2 with checkpoints every 3 steps, never interrupted."""
    root = tmp_path_factory.mktemp("straight")
    code = run_plan(_plan(2), steps=6, metrics_path=str(root / "m.jsonl"), checkpoint_dir=root / "ckpt",
                    checkpoint_every=3, **FAST)
    assert code == 0
    losses = _losses(root / "m.jsonl")
    assert sorted(losses) == [0, 1, 2, 3, 4, 5]
    return root, losses


# ---- resume ----------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_resume_after_sigkill_of_every_rank_is_exact(straight, tmp_path, capsys):
    root, expected = straight
    d = tmp_path / "ckpt"
    # Every rank SIGKILLs itself before step 3, after checkpoint step-000003 is complete.
    code = run_plan(_plan(2), steps=6, checkpoint_dir=d, checkpoint_every=3, _fault="kill@*:3", **FAST)
    err = capsys.readouterr().err
    assert code == 1 and "killed by signal SIGKILL" in err
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [3]
    code = run_plan(_plan(2), steps=6, checkpoint_dir=d, checkpoint_every=3, resume=True,
                    metrics_path=str(tmp_path / "m.jsonl"), **FAST)
    assert code == 0
    resumed = _losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == [3, 4, 5]
    assert all(resumed[s] == expected[s] for s in (3, 4, 5)), (resumed, expected)  # bitwise
    # The final weights and optimizer states equal the straight run's, bit for bit.
    a, b = ckpt.load_checkpoint(d), ckpt.load_checkpoint(root / "ckpt")
    assert a.step == b.step == 6 and a.params.keys() == b.params.keys()
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
    assert a.optimizer_state.keys() == b.optimizer_state.keys()
    for name, state in a.optimizer_state.items():
        assert all(torch.equal(state[k], b.optimizer_state[name][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.timeout(90)
def test_crash_in_the_middle_of_a_checkpoint_write_keeps_the_previous_one(straight, tmp_path, capsys):
    _, expected = straight
    d = tmp_path / "ckpt"
    # Rank 1 dies halfway through writing its DCP data file of checkpoint 6.
    code = run_plan(_plan(2), steps=6, checkpoint_dir=d, checkpoint_every=3, _fault="kill-in-checkpoint@1:6", **FAST)
    err = capsys.readouterr().err
    assert code == 1 and re.search(r"rank 1 was killed by signal SIGKILL", err), err
    partial = d / ".tmp-step-000006"  # rank 1's DCP data file is there, torn; no metadata, no manifest
    assert (partial / "__1_0.distcp").exists() and not (partial / "manifest.json").exists()
    assert not (d / "step-000006").exists()
    assert ckpt.latest_checkpoint(d) == d / "step-000003"
    assert ckpt.load_full_state_dict(d)  # the previous checkpoint loads whole
    code = run_plan(_plan(2), steps=6, checkpoint_dir=d, checkpoint_every=3, resume=True,
                    metrics_path=str(tmp_path / "m.jsonl"), **FAST)
    assert code == 0
    resumed = _losses(tmp_path / "m.jsonl")
    assert sorted(resumed) == [3, 4, 5] and all(resumed[s] == expected[s] for s in resumed)
    assert not partial.exists() and ckpt.latest_checkpoint(d) == d / "step-000006"


@pytest.mark.timeout(120)
def test_zero3_resume_after_a_kill_during_a_save_is_exact(tmp_path, capsys):
    """(pp 2, dp 2, ZeRO-3): FSDP2 shards of parameters and AdamW state saved as DCP shards; a rank
    killed halfway through its data file of checkpoint 4, then a resume from checkpoint 2: the
    losses of steps 2-3 equal a straight run's bit for bit."""
    plan = _plan(2, dp=2, zero=3)
    code = run_plan(plan, steps=4, metrics_path=str(tmp_path / "straight.jsonl"), **FAST)
    assert code == 0
    expected = _losses(tmp_path / "straight.jsonl")
    d = tmp_path / "ckpt"
    code = run_plan(plan, steps=4, checkpoint_dir=d, checkpoint_every=2, _fault="kill-in-checkpoint@2:4", **FAST)
    assert code == 1 and "rank 2 was killed by signal SIGKILL" in capsys.readouterr().err
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [2]
    code = run_plan(plan, steps=4, checkpoint_dir=d, checkpoint_every=2, resume=True,
                    metrics_path=str(tmp_path / "resumed.jsonl"), **FAST)
    assert code == 0
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [2, 3] and all(resumed[s] == expected[s] for s in resumed), (resumed, expected)


class _FakePM:
    """The public surface of PartitionedModel that checkpoints use."""

    def __init__(self, params):
        self.params = params
        self.aliases = {}

    def named_parameters(self):
        return iter(self.params.items())

    def state_dict(self):
        return {n: p.detach() for n, p in self.params.items()}

    @torch.no_grad()
    def load_state_dict(self, sd, strict=False):
        for n, p in self.params.items():
            p.copy_(sd[n])
        return []


@pytest.mark.timeout(30)
def test_incomplete_or_corrupt_checkpoints_are_ignored(tmp_path):
    params = {"w": torch.nn.Parameter(torch.randn(4, 4))}
    pm = _FakePM(params)
    opt = torch.optim.AdamW(params.values())
    params["w"].grad = torch.ones(4, 4)
    opt.step()
    ckpt.save_checkpoint(tmp_path, 1, pm, opt)
    good = ckpt.save_checkpoint(tmp_path, 2, pm, opt)
    assert ckpt.latest_checkpoint(tmp_path) == good
    # A newer directory without a manifest, one with a truncated DCP data file, one with a bad manifest,
    # one without DCP's metadata, one of the old per-rank torch.save format.
    (tmp_path / "step-000005").mkdir()
    (tmp_path / "step-000005" / "__0_0.distcp").write_bytes(b"partial")
    broken = ckpt.save_checkpoint(tmp_path, 4, pm, opt)
    data = (broken / "__0_0.distcp").read_bytes()
    (broken / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    bad = ckpt.save_checkpoint(tmp_path, 3, pm, opt)
    (bad / "manifest.json").write_text(f'{{"format": "{ckpt.CHECKPOINT_FORMAT}", "step": 3, "fil')
    (ckpt.save_checkpoint(tmp_path, 6, pm, opt) / ".metadata").unlink()
    old = ckpt.save_checkpoint(tmp_path, 7, pm, opt)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": "autoplan-checkpoint/1"}))
    (tmp_path / ".tmp-step-000009").mkdir()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]
    assert ckpt.latest_checkpoint(tmp_path) == good
    loaded = ckpt.load_checkpoint(tmp_path)
    assert loaded.step == 2 and torch.equal(loaded.params["w"], params["w"].detach())
    assert set(loaded.optimizer_state["w"]) == {"step", "exp_avg", "exp_avg_sq"}  # keyed by name
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_checkpoint(tmp_path / "empty")
    # Restoring into fresh objects reproduces the optimizer step exactly.
    params2 = {"w": torch.nn.Parameter(torch.zeros(4, 4))}
    opt2 = torch.optim.AdamW(params2.values())
    assert ckpt.restore(loaded, _FakePM(params2), opt2) == 2
    for p in (params["w"], params2["w"]):
        p.grad = torch.full((4, 4), 0.5)
    opt.step()
    opt2.step()
    assert torch.equal(params["w"], params2["w"])


def _refused(plan, **kwargs) -> str:
    """The one line `run_plan` raises (the CLI prints it and exits 2)."""
    with pytest.raises(ValueError) as info:
        run_plan(plan, **kwargs)
    assert "\n" not in str(info.value), info.value
    return str(info.value)


@pytest.mark.timeout(30)
def test_run_plan_refuses_bad_checkpoint_arguments(tmp_path, capsys, straight):
    plan = _plan(2)
    lines = [_refused(plan, checkpoint_dir=tmp_path, checkpoint_every=0), _refused(plan, resume=True)]
    (tmp_path / "file").write_text("x")
    lines.append(_refused(plan, checkpoint_dir=tmp_path / "file", checkpoint_every=1))
    lines.append(_refused(plan, checkpoint_dir=tmp_path, resume=True, _fault="explode@1:1"))
    other = "gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
    m = zoo.build_model(other, device="meta")
    other_plan = make_plan(other, model_fingerprint(m), trace_model(m, (torch.zeros(2, 16, dtype=torch.long),)).block_names,
                           pp=2)
    lines.append(_refused(other_plan, checkpoint_dir=straight[0] / "ckpt", resume=True))
    # A directory of checkpoints in the format before DCP: refused, not silently restarted at step 0.
    (tmp_path / "old" / "step-000003").mkdir(parents=True)
    (tmp_path / "old" / "step-000003" / "manifest.json").write_text('{"format": "autoplan-checkpoint/1", "step": 3}')
    lines.append(_refused(plan, checkpoint_dir=tmp_path / "old", resume=True))
    assert capsys.readouterr().err == ""  # the API raises; only the CLI prints
    assert "fingerprint" in lines[-2] and "autoplan-checkpoint/1" in lines[-1]


def test_synthetic_data_is_a_pure_function_of_seed_and_step():
    a = synthetic_batch(0, 4, 8, 16, 64)
    assert all(torch.equal(x, y) for x, y in zip(a, synthetic_batch(0, 4, 8, 16, 64)))
    assert not torch.equal(a[0], synthetic_batch(0, 5, 8, 16, 64)[0])
    assert not torch.equal(a[0], synthetic_batch(1, 4, 8, 16, 64)[0])


# ---- resharding --------------------------------------------------------------------------------------


def _load_resharded(rank, world_size, plan, path):
    from datetime import timedelta

    from autoplan.runtime import partition

    pm = partition(GPT, plan, device="cpu", seed=123, timeout=timedelta(seconds=10))  # other init weights
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    step = ckpt.restore(ckpt.load_checkpoint(path), pm, opt)
    names = {id(p): n for n, p in pm.named_parameters()}
    torch.distributed.barrier()  # restore is not collective: rank 0's store stays up until all are done
    return step, {n: t.clone() for n, t in pm.state_dict().items()}, {
        names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.timeout(90)
def test_a_pp2_checkpoint_loads_under_pp4_with_other_cuts_and_into_a_plain_model(straight):
    root, _ = straight
    path = root / "ckpt"  # written under pp=2, cuts after blocks 4 and 7
    full = ckpt.load_full_state_dict(path)
    opt_full = ckpt.load_full_optimizer_state(path)
    # A plain single-process model takes the merged dict as its own (tied aliases included).
    model = zoo.build_model(GPT, device="cpu", seed=7)
    model.load_state_dict(full, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, full[name]), name
    # pp = 4 with different cuts: every rank gets exactly its parameters and their AdamW state.
    plan4 = _plan(4, cuts=(1, 2, 4, 7))
    results = run_ranks(_load_resharded, 4, plan4, path, timeout_s=80)
    seen = set()
    for rank, (step, params, opt_state) in results.items():
        assert step == 6
        for name, tensor in params.items():
            assert torch.equal(tensor, full[name]), (rank, name)
            seen.add(name)
        for name, state in opt_state.items():
            src = opt_full.get(name) or opt_full[{"output.weight": "tok_embeddings.weight"}.get(name, name)]
            assert all(torch.equal(state[k], src[k]) for k in ("step", "exp_avg", "exp_avg_sq")), (rank, name)
    assert {n for n, _ in model.named_parameters()} <= seen


# ---- no hangs ---------------------------------------------------------------------------------------


@pytest.mark.timeout(100)
def test_a_rank_killed_mid_step_makes_every_other_rank_exit_nonzero_ten_times_out_of_ten(capsys):
    """SIGKILL one of 4 ranks in the middle of a step (at its N-th P2P transfer, or during the
    dp gradient all-reduce): every other rank fails by itself (no launcher kill) within 60 s."""
    plans = [_plan(4), _plan(2, dp=2)]
    durations = []
    for rep in range(10):
        victim, nth = rep % 4, 1 + rep // 4
        start = time.monotonic()
        # A long grace period: the survivors must exit on their own (timeouts, dead-peer errors).
        code = run_plan(plans[rep % 2], steps=50, _fault=f"kill-mid-step@{victim}:1:{nth}", _grace_s=55, **FAST)
        durations.append(time.monotonic() - start)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 1 and durations[-1] < 60, (rep, durations[-1], line)
        assert line.startswith(f"autoplan: error: rank {victim} was killed by signal SIGKILL"), (rep, line)
        assert "stopped by the launcher" not in line and "exited cleanly" not in line, (rep, line)
        assert line.count("exit code 1") == 3, (rep, line)
    print("kill-mid-step durations (s):", [round(d, 1) for d in durations])


@pytest.mark.timeout(60)
def test_a_hung_rank_is_caught_by_timeouts_and_stopped_by_the_launcher(capsys):
    start = time.monotonic()
    code = run_plan(_plan(2), steps=20, _fault="hang@1:2", _grace_s=2, _start_method="forkserver", timeout_s=3)
    elapsed = time.monotonic() - start
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and elapsed < scaled_timeout_s(30), (elapsed, line)
    # Rank 0 waits on rank 1, times out after 3 s and fails; rank 1 (hung, alive) is stopped by the
    # launcher and named: it got least far (its heartbeat says where it is).
    assert line.startswith("autoplan: error: rank 1 stopped making progress at step 2"), line
    assert "rank 0: exit code 1, P2PTimeout" in line, line
