"""Training a model on real data through `autoplan run` (issue 41 items 3-5): a token file (nanoGPT's
uint16 .bin), AdamW with weight-decay groups, warmup then cosine decay, `--clip-grad 1.0`, evaluation,
checkpoints and resume, through the CLI (`autoplan suggest ... --out p.json`, then `autoplan run
p.json ...` or a job file), against a single-process loop written with torch alone: the model built
as the runtime builds it (the same seed), `torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW` over
groups made here by the usual rule (1-D parameters undecayed), and torch's own schedulers
(`SequentialLR([LinearLR, CosineAnnealingLR])`), not autoplan's closed form.

- default tier: 6 steps at dp 2 from a job file with a flag overriding it, with evaluation, then a
  resume on other data refused; data mistakes refused in one line before any rank;
- extended: 50 steps at pp 2 x tp 2 (4 ranks) and at ep 2 (a mixture of experts, 2 ranks): losses and
  clipped global norms of every step equal the single process (fp32, rtol 1e-5); the run killed before
  step 30 and resumed gives the straight run's remaining losses and norms bitwise, the data position
  included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _cli import run_main

from autoplan.graph.aux_loss import aux_loss_scale, recording_aux_losses
from autoplan.plan import Plan
from autoplan.runtime.launcher.datasets import open_dataset
from autoplan.sources import parse_source

LLAMA = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"
MOE = ("moe:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=48,vocab_size=64,max_seq_len=16,"
       "num_experts=4,experts_per_token=2,num_shared_experts=1")
SEQ, VOCAB, GLOBAL_BATCH, MICRO_BATCH = 16, 64, 8, 2
LR, WARMUP, MIN_LR, WEIGHT_DECAY, CLIP = 3e-3, 5, 3e-4, 0.1, 1.0
OPTIMIZER_FLAGS = ("--lr", str(LR), "--warmup-steps", str(WARMUP), "--lr-schedule", "cosine", "--min-lr", str(MIN_LR),
                   "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP), "--betas", "0.9,0.95")


def _tokens(path) -> str:
    """A nanoGPT-style uint16 token file with structure to learn (a fixed map of the previous token,
    80 % of the time), so the loss falls and the early steps' norms exceed the clip."""
    rng = np.random.default_rng(0)
    ids = [0]
    for _ in range(5999):
        ids.append((ids[-1] * 5 + 3) % VOCAB if rng.random() < 0.8 else int(rng.integers(0, VOCAB)))
    np.array(ids, dtype=np.uint16).tofile(path)
    return str(path)


def _cli(*args: str, env: dict | None = None, timeout: int = 500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _suggest(tmp_path, spec: str, cluster: str, *pins: str) -> str:
    out = tmp_path / "p.json"
    made = _cli("suggest", "--model", spec, "--cluster", cluster, "--global-batch", str(GLOBAL_BATCH), "--seq-len",
                str(SEQ), "--dtype", "fp32", "--micro-batch-size", str(MICRO_BATCH), *pins, "--out", str(out))
    assert made.returncode == 0, made.stderr
    return str(out)


def _records(path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a metrics file."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def _reference(spec: str, data: str, steps: int, eval_every: int | None = None,
               eval_batches: int = 0) -> tuple[list[float], list[float], list[float], dict[int, float]]:
    """One process, torch alone: (losses, clipped global norms, learning rates, {step: eval loss})."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: 20 s for 50 MoE steps, minutes with threads on a loaded machine
    try:
        return _reference_loop(spec, data, steps, eval_every, eval_batches)
    finally:
        torch.set_num_threads(threads)


def _reference_loop(spec: str, data: str, steps: int, eval_every: int | None,
                    eval_batches: int) -> tuple[list[float], list[float], list[float], dict[int, float]]:
    source = parse_source(spec)
    model = source.build("cpu")  # initialized by name with seed 0, as `autoplan run --seed 0` builds it
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # norms and biases undecayed (nanoGPT, Megatron-LM)
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    assert decay and no_decay
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / (WARMUP + 1), end_factor=1.0, total_iters=WARMUP),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - WARMUP, eta_min=MIN_LR)], [WARMUP])
    dataset = open_dataset(data, seq_len=SEQ, seed=0)
    chunks = GLOBAL_BATCH // MICRO_BATCH  # the plans' micro-batches, in the order of the dp replicas' rows

    def loss_of(ids, targets, backward: bool) -> float:
        total = 0.0
        for k in range(chunks):
            rows = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
            loss = source.loss_fn(model(ids[rows]), targets[rows]) / chunks
            if backward:
                with aux_loss_scale(1 / chunks), recording_aux_losses() as aux:
                    loss.backward()
                total += loss.item() + sum(float(a) for a in aux)  # a router's loss, as `pm.step` reports it
            else:
                total += loss.item()
        return total

    losses, norms, lrs, evals = [], [], [], {}
    for step in range(steps):
        losses.append(loss_of(*dataset.batch(step, GLOBAL_BATCH), backward=True))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if eval_every and (step + 1) % eval_every == 0:
            with torch.no_grad():
                evals[step] = sum(loss_of(*dataset.batch(k, GLOBAL_BATCH), backward=False)
                                  for k in range(eval_batches)) / eval_batches
    return losses, norms, lrs, evals


def _assert_matches(records: list[dict], losses: list[float], norms: list[float], lrs: list[float], what: str,
                    falls_by: float = 0.5) -> None:
    assert [r["step"] for r in records] == list(range(len(losses))), what
    for r, loss, norm, lr in zip(records, losses, norms, lrs):
        assert r["loss"] == pytest.approx(loss, rel=1e-5), (what, r["step"], r["loss"], loss)
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-5), (what, r["step"], r["grad_norm"], norm)
        assert r["lr"] == pytest.approx(lr, rel=1e-12), (what, r["step"], r["lr"], lr)
    assert any(n > CLIP for n in norms), f"{what}: no step was clipped, the test would not see clipping"
    assert losses[-1] < losses[0] - falls_by, f"{what}: the loss did not fall: {losses[0]} -> {losses[-1]}"
    assert len({round(lr, 12) for lr in lrs}) == len(lrs), f"{what}: the schedule did not change the rate: {lrs}"


JOB = """\
[job]
plan = "p.json"
nproc = 2

[training]
steps = 50
data = "train.bin"
clip_grad = 1.0

[optimizer]
lr = 3e-3
betas = [0.9, 0.95]
weight_decay = 0.1

[lr_scheduler]
schedule = "cosine"
warmup_steps = 5
min_lr = 3e-4

[eval]
every = 3
data = "train.bin"
batches = 2

[metrics]
path = "m.jsonl"
"""


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_job_file_run_at_dp2_on_a_token_file_equals_a_single_process(tmp_path):
    """The user's path in the default tier: a token file, warmup + cosine, weight-decay groups,
    clipping and evaluation from a job file, `--steps 6` on the command line overriding its 50 (the
    cosine then decays over 6 steps): every loss, norm and learning rate equals torch's loop."""
    data = _tokens(tmp_path / "train.bin")
    _suggest(tmp_path, LLAMA, "1x2xcpu", "--tp", "1", "--pp", "1", "--dp", "2")
    (tmp_path / "job.toml").write_text(JOB)
    ck = str(tmp_path / "ck")
    ran = _cli("run", "--config", str(tmp_path / "job.toml"), "--steps", "6", "--timeout", "120", "--checkpoint-dir", ck)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    records, evals = _records(tmp_path / "m.jsonl")
    losses, norms, lrs, ref_evals = _reference(LLAMA, data, 6, eval_every=3, eval_batches=2)
    _assert_matches(records, losses, norms, lrs, "dp2", falls_by=0.05)
    assert [e["step"] for e in evals] == [2, 5] == sorted(ref_evals)
    for e in evals:
        assert e["eval_loss"] == pytest.approx(ref_evals[e["step"]], rel=1e-5), (e, ref_evals)
    assert "eval step 5  loss" in ran.stdout, ran.stdout
    # The checkpoint records its data: a resume on another order of the same file (--seed 1), or on
    # synthetic data, is refused before any rank starts, in one line naming both.
    for flags, words in ((["--data", data, "--seed", "1"], ["seed 0", "seed 1"]), ([], ["synthetic data"])):
        again = run_main("run", str(tmp_path / "p.json"), "--steps", "8", "--checkpoint-dir", ck, "--resume", *flags)
        assert again.returncode == 2, (flags, again.stdout, again.stderr)
        assert all(w in again.stderr for w in words) and "resume with the same --data" in again.stderr, again.stderr


def _straight_killed_resumed(tmp_path, plan: str, nproc: int) -> tuple[list[dict], list[dict]]:
    """The straight 50-step run's records, and the records of the same run killed before step 30 and
    resumed (steps 30-49)."""
    data = str(tmp_path / "train.bin")
    common = ("run", plan, "--nproc", str(nproc), "--steps", "50", "--data", data, *OPTIMIZER_FLAGS,
              "--checkpoint-every", "10", "--timeout", "120")
    straight = _cli(*common, "--checkpoint-dir", str(tmp_path / "ck-straight"), "--metrics", str(tmp_path / "m.jsonl"))
    assert straight.returncode == 0, straight.stdout + straight.stderr
    killed = _cli(*common, "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "killed.jsonl"),
                  env={"AUTOPLAN_FAULT": "kill@*:30"})
    assert killed.returncode == 1, killed.stdout + killed.stderr
    resumed = _cli(*common, "--checkpoint-dir", str(tmp_path / "ck"), "--metrics", str(tmp_path / "resumed.jsonl"),
                   "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "(step 30)" in resumed.stdout, resumed.stdout
    return _records(tmp_path / "m.jsonl")[0], _records(tmp_path / "resumed.jsonl")[0]


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(1200)  # three runs of 50 steps: 270-590 s on a 2-core machine loaded 7x
@pytest.mark.parametrize("spec, cluster, pins", [
    (LLAMA, "1x4xcpu", ("--tp", "2", "--pp", "2", "--dp", "1")),
    (MOE, "1x2xcpu", ("--tp", "1", "--pp", "1", "--dp", "2", "--ep", "2")),
], ids=["pp2-tp2", "ep2"])
def test_fifty_steps_on_a_token_file_equal_a_single_process_and_resume_bitwise(tmp_path, spec, cluster, pins):
    data = _tokens(tmp_path / "train.bin")
    plan_path = _suggest(tmp_path, spec, cluster, *pins)
    plan = Plan.load(plan_path)
    assert (plan.tp, plan.pp, plan.dp, getattr(plan, "ep", 1)) in ((2, 2, 1, 1), (1, 1, 2, 2)), plan
    straight, resumed = _straight_killed_resumed(tmp_path, plan_path, plan.num_gpus)
    losses, norms, lrs, _ = _reference(spec, data, 50)
    _assert_matches(straight, losses, norms, lrs, cluster)
    # The resumed run: steps 30-49, bitwise the straight run's (weights, AdamW state, schedule and data position).
    assert [r["step"] for r in resumed] == list(range(30, 50))
    for r, s in zip(resumed, straight[30:]):
        assert (r["loss"], r["grad_norm"], r["lr"]) == (s["loss"], s["grad_norm"], s["lr"]), (r, s)



def test_data_mistakes_are_one_line_before_any_rank(tmp_path):
    """A token id past the vocabulary, a missing file, evaluation without its data: one line, exit 2,
    nothing launched (`autoplan run` in this process: refused before any rank)."""
    data = _tokens(tmp_path / "train.bin")
    plan = str(tmp_path / "p.json")
    made = run_main("suggest", "--model", LLAMA, "--cluster", "1x1xcpu", "--global-batch", str(GLOBAL_BATCH),
                    "--seq-len", str(SEQ), "--dtype", "fp32", "--out", plan)
    assert made.returncode == 0, made.stderr
    wide = tmp_path / "wide.bin"
    np.array([1, 2, 300, 4] * 100, dtype=np.uint16).tofile(wide)
    for flags, words in ((["--data", str(wide)], ["--data", "300", "vocabulary of 64"]),
                         (["--data", str(tmp_path / "missing.bin")], ["--data", "missing.bin"]),
                         (["--eval-every", "2"], ["--eval-every needs --eval-data"]),
                         (["--data", data, "--eval-every", "2", "--eval-data", str(wide)], ["--eval-data", "300"])):
        ran = run_main("run", plan, "--steps", "2", *flags)
        assert ran.returncode == 2, (flags, ran.stdout, ran.stderr)
        line = ran.stderr.strip().splitlines()[-1]
        assert all(w in line for w in words) and "Traceback" not in ran.stderr, (flags, ran.stderr)
        assert "launching" not in ran.stderr, (flags, ran.stderr)
