"""Context parallelism through the public API: plans from `autoplan.suggest` with `cp` pinned, run by
`autoplan.partition(...).step` on 4 gloo ranks, against a single-process reference of the whole
model (loss and every gradient), and the user's CLI path (`suggest --cp ... --out`, `autoplan run`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _cli import run_main
from _dist import run_ranks
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH, _full, _reference

import autoplan
from autoplan.runtime.parallel.context import chunk_positions

SPEC = "llama:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=256,max_seq_len=64"
SEQ_LEN = 32
LAYOUTS = {
    "cp2-dp4": dict(tp=1, pp=1, dp=4, cp=2),     # two replicas, each splitting its sequences over 2 ranks
    "cp4": dict(tp=1, pp=1, dp=4, cp=4),         # one replica, 8 chunks of 4 tokens
    "cp2-pp2": dict(tp=1, pp=2, dp=2, cp=2, schedule="1f1b"),
    "cp2-pp2-zb": dict(tp=1, pp=2, dp=2, cp=2, schedule="zb-h1"),
    "cp2-tp2": dict(tp=2, pp=1, dp=2, cp=2),
    "cp2-zero3": dict(tp=1, pp=1, dp=4, cp=2, zero=3),
    "cp2-recompute": dict(tp=1, pp=2, dp=2, cp=2, recompute="full"),
    "cp2-selective": dict(tp=1, pp=1, dp=4, cp=2, recompute="selective"),  # the kernel checkpointed under cp
}


def _rank_job(rank: int, world_size: int, plans: dict) -> dict:
    out = {}
    for name, plan in plans.items():
        pm = autoplan.partition(SPEC, plan, device="cpu")
        template = pm.output_template
        inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
        loss = pm.step(*inputs, target=target)
        grads = {n: _full(p.grad) for n, p in pm.named_parameters()}  # collective for tp / FSDP shards
        if pm.layout.dp_index or pm.layout.tp_index:
            grads = {}
        out[name] = dict(loss=None if loss is None else float(loss), grads=grads,
                         batch=(inputs, target) if rank == 0 else None)
    return out


def test_chunks_are_load_balanced():
    """Rank i holds chunks i and 2cp-1-i: every rank's causal attention covers as many key positions."""
    cp, seq = 4, 64
    held = [chunk_positions(seq, cp, i) for i in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    visible = [int((p + 1).sum()) for p in held]  # keys a causal query at position p sees: p + 1
    assert len(set(visible)) == 1


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_context_parallel_matches_a_single_process_reference():
    plans = {name: autoplan.suggest(SPEC, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32",
                                    micro_batch_size=MICRO_BATCH, top=1, **pins)[0] for name, pins in LAYOUTS.items()}
    for name, plan in plans.items():
        assert plan.cp == LAYOUTS[name]["cp"], name
    results = run_ranks(_rank_job, 4, plans, timeout_s=500, pg_timeout_s=120)
    inputs, target = results[0][next(iter(plans))]["batch"]
    for name, plan in plans.items():
        model, ref_loss, ref_grads = _reference(SPEC, plan, inputs, target)
        losses = [r[name]["loss"] for r in results.values() if r[name]["loss"] is not None]
        rtol = 1e-4 if plan.tp > 1 or plan.zero >= 2 else 1e-5
        assert losses and all(loss == pytest.approx(ref_loss, rel=rtol) for loss in losses), (name, losses, ref_loss)
        grads = {}
        for r in results.values():
            grads.update(r[name]["grads"])
        assert set(grads) == set(ref_grads), (name, set(ref_grads) ^ set(grads))
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=rtol * scale,
                                       msg=lambda m, n=n, name=name: f"{name}: {n}: {m}")


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_suggest_with_cp_then_autoplan_run(tmp_path):
    out = tmp_path / "cp.json"
    result = run_cli("suggest", "--model", SPEC, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32",
                     "--cp", "2", "--pp", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    plan = json.loads(out.read_text())
    assert plan["cp"] == 2 and plan["pp"] == 2 and plan["dp"] == 2
    assert "cp 2 (pinned): each GPU holds 16 of the 32 tokens" in result.stdout
    run = run_cli("run", str(out), "--steps", "2")
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize(("model", "args", "words"), [
    (SPEC, ["--cp", "3"], "--cp 3 does not divide the sequence of 32 tokens into 2 * 3 equal chunks"),
    ("gpt:num_layers=2,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=64", ["--cp", "2"],
     "--cp 2 needs a model context parallelism can split: GPTModel cannot be told its tokens' positions"),
    (SPEC, ["--cp", "2", "--dp", "1"], "must divide --dp 1"),
])
def test_suggest_refuses_bad_cp_pins_in_one_line(model, args, words, capsys):
    # The CLI's entry point in this process (a fresh `python -m autoplan` per case cost ~7 s of the suite).
    from autoplan.cli import main

    code = main(["suggest", "--model", model, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32", *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_llama31_405b_at_131k_tokens_on_16384_h100_chooses_cp_and_says_why():
    """The long-context job of Llama 3 405B (16M tokens per step): `suggest` searches cp with the
    other dimensions and explains the choice; the JSON plan carries cp."""
    result = run_main("suggest", "--model", "llama3.1-405b", "--cluster", "2048x8xH100-80GB", "--global-batch", "128",
                      "--seq-len", "131072", "--top", "3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    best = data["plans"][0]
    assert best["cp"] > 1 and best["fits"], (best["cp"], best["fits"])
    assert best["predicted"]["breakdown"]["cp_comm_s"] > 0
    notes = " ".join(data["search"]["notes"])
    assert f"cp {best['cp']}: each GPU holds {131072 // best['cp']:,} of the 131,072 tokens" in notes, notes
    assert data["search"]["time_s"] < 30, data["search"]["time_s"]  # seconds (about 4 s on a 2-core machine)
