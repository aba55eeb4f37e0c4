"""Context parallelism with capacity-routed experts (the zoo's moe below capacity_factor E / k, whose
experts drop tokens), run as Megatron-LM runs it: each cp rank counts an expert's capacity over the
tokens it holds of each sequence (models/moe.py [Note: capacity under context parallelism]).

Plans from `autoplan suggest --cp 2 ... --out p.json`, run by `autoplan.partition(spec, "p.json").step`
on 4 gloo ranks (and one by `autoplan run p.json`), against a single process that applies the same
capacity to each rank's share of every sequence (loss and every gradient, the experts' slices put back
together: tests/test_expert_parallel.py's helpers), and checked to differ from one that applies it to
whole sequences (the capacity bites). The planner's side: `suggest` takes cp for such a model, pinned
or not, says what it changes, and prices a rank's experts at the capacity of the tokens it holds."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _cli import run_main
from _dist import run_ranks
from test_expert_parallel import check_against_reference, step_and_collect
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH, _reference

import autoplan
from autoplan.graph.positions import sequence_split_note, sequence_split_refusal
from autoplan.models.moe import MoEFeedForward
from autoplan.runtime.parallel.context import chunk_positions
from autoplan.sources import parse_source

SEQ_LEN = 32
# E 4, top-2: capacity_factor 1 gives each expert the sequence's mean load (16 of 32 tokens whole,
# 8 of a cp 2 rank's 16), so any imbalance drops tokens; E / k = 2 would drop none.
SPEC = ("moe:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=48,vocab_size=128,max_seq_len=64,"
        "num_experts=4,experts_per_token=2,num_shared_experts=1,capacity_factor=1")
NOTE = "each cp rank counts its experts' capacity over the tokens it holds of each sequence, as Megatron-LM does"
LAYOUTS = {
    "cp2": ["--tp", "1", "--pp", "1", "--dp", "4", "--cp", "2", "--ep", "1"],
    "cp2-ep2": ["--tp", "1", "--pp", "1", "--dp", "4", "--cp", "2", "--ep", "2"],  # Megatron-LM's cp with ep
    "cp2-pp2": ["--tp", "1", "--pp", "2", "--dp", "2", "--cp", "2", "--ep", "1"],
    "cp2-tp2-ep2": ["--tp", "2", "--pp", "1", "--dp", "2", "--cp", "2", "--ep", "2"],
}


@contextlib.contextmanager
def capacity_per_rank_share(cp: int) -> Iterator[None]:
    """In this process, every capacity-routed MoE layer applies its capacity to the tokens each of
    `cp` ranks would hold of every sequence (chunks r and 2 cp - 1 - r, in that order:
    runtime/parallel/context.py `chunk_positions`), as a cp run does; the router and the balance loss see the
    whole sequence, as they do under cp (its counts summed over the cp group)."""
    whole = MoEFeedForward._through_capacity

    def by_shares(self, x, chosen, weights, picks):
        b, s, h = x.shape
        k, share = self.top_k, s // cp
        order = torch.cat([chunk_positions(s, cp, r) for r in range(cp)])  # rank 0's tokens, then rank 1's...
        out = whole(self, x[:, order].reshape(b * cp, share, h),
                    chosen.view(b, s, k)[:, order].reshape(b * cp, share * k),
                    weights[:, order].reshape(b * cp, share, k),
                    picks.view(b, s, k, -1)[:, order].reshape(b * cp, share * k, picks.shape[-1]))
        return out.reshape(b, s, h)[:, order.argsort()]

    MoEFeedForward._through_capacity = by_shares
    try:
        yield
    finally:
        MoEFeedForward._through_capacity = whole


def _suggest(layout: str, out: Path, cluster: str = "1x4xcpu") -> Path:
    result = run_main("suggest", "--model", SPEC, "--cluster", cluster, "--global-batch", str(GLOBAL_BATCH),
                      "--seq-len", str(SEQ_LEN), "--micro-batch-size", str(MICRO_BATCH), "--dtype", "fp32",
                      *LAYOUTS[layout], "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["cp"] == 2
    return out


def _rank_job(rank: int, world_size: int, cases: dict) -> dict:
    return {name: step_and_collect(autoplan.partition(SPEC, path, device="cpu"), rank) for name, path in cases.items()}


def _against_one_process(name: str, plan: autoplan.Plan, results: dict) -> None:
    """The loss and every gradient of layout `name` against the single process in force
    (`_reference`); the experts' slices put back together under ep (`check_against_reference`)."""
    if plan.ep > 1:
        check_against_reference(SPEC, name, plan, results)
        return
    inputs, target = results[0][name]["batch"]
    _, ref_loss, ref_grads = _reference(SPEC, plan, inputs, target)
    losses = [r[name]["loss"] for r in results.values() if r[name]["loss"] is not None]
    assert losses and all(loss == pytest.approx(ref_loss, rel=1e-5) for loss in losses), (name, losses, ref_loss)
    grads = {}
    for r in results.values():
        grads.update(r[name]["grads"])
    assert set(grads) == set(ref_grads), (name, set(ref_grads) ^ set(grads))
    rtol = 1e-4 if plan.tp > 1 else 1e-5
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=rtol * scale, msg=lambda m, n=n: f"{name}: {n}: {m}")


def _check(layouts: list[str], tmp_path: Path) -> None:
    planned = {name: str(_suggest(name, tmp_path / f"{name}.json")) for name in layouts}
    results = run_ranks(_rank_job, 4, planned, timeout_s=500, pg_timeout_s=120)
    for name, path in planned.items():
        plan = autoplan.Plan.load(path)
        with capacity_per_rank_share(plan.cp):
            _against_one_process(name, plan, results)
    # The capacity bites: a single process counting it over whole sequences routes other tokens, and
    # the experts' gradients show it (the loss moves by ~1e-5 only: the experts' outputs are small at
    # initialization).
    inputs, target = results[0][layouts[0]]["batch"]
    plan = autoplan.Plan.load(planned[layouts[0]])
    _, _, whole = _reference(SPEC, plan, inputs, target)
    with capacity_per_rank_share(plan.cp):
        _, _, shares = _reference(SPEC, plan, inputs, target)
    moved = max(float((whole[n] - shares[n]).abs().max() / whole[n].abs().max()) for n in whole if "experts.w" in n)
    assert moved > 0.05, moved


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_capacity_routing_at_cp2_ep2_matches_one_process_with_the_capacity_per_rank(tmp_path):
    _check(["cp2-ep2"], tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_capacity_routing_at_cp2_cp2_pp2_and_cp2_tp2_ep2_matches_one_process_with_the_capacity_per_rank(tmp_path):
    _check(["cp2", "cp2-pp2", "cp2-tp2-ep2"], tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_suggest_cp2_then_autoplan_run_says_which_tokens_drop(tmp_path):
    """The user's path on 2 ranks: the plan carries the note, `run` says it once before its ranks
    start, and trains."""
    path = tmp_path / "p.json"
    result = run_main("suggest", "--model", SPEC, "--cluster", "1x2xcpu", "--global-batch", str(GLOBAL_BATCH),
                      "--seq-len", str(SEQ_LEN), "--dtype", "fp32", "--cp", "2", "--out", str(path))
    assert result.returncode == 0, result.stderr
    plan = json.loads(path.read_text())
    assert plan["cp"] == 2 and any(NOTE in note for note in plan["notes"]), plan["notes"]
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(path), "--steps", "2"], capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-2000:]
    said = [line for line in run.stderr.splitlines() if NOTE in line]
    assert len(said) == 1 and "capacity_factor=2 or dropless drops none" in said[0], run.stderr[-2000:]


def test_no_note_where_nothing_drops():
    """At capacity_factor >= E / k, or dropless, a cp run computes what one process does: no note."""
    for options in ("capacity_factor=2", "dropless=true"):
        model = parse_source(SPEC.replace("capacity_factor=1", options)).build("meta")
        assert sequence_split_refusal(model, True) is None and sequence_split_note(model) is None, options
    model = parse_source(SPEC).build("meta")
    assert NOTE in sequence_split_note(model)


def test_a_rank_prices_its_experts_at_the_capacity_of_the_tokens_it_holds():
    """What the search prices per rank at cp 2 (the profile at the whole sequence, times the rank's
    share, cost/config.py `batch_share`) is what a rank computes and sends at the capacity of its own
    16 tokens (the model profiled at 16, the length the runtime traces a cp 2 rank at): the experts'
    FLOPs and the bytes their all-to-all sends, block by block."""
    from autoplan.cost.config import ParallelConfig

    whole = autoplan.profile(SPEC, batch_size=2, seq_len=SEQ_LEN, dtype="fp32")
    held = autoplan.profile(SPEC, batch_size=2, seq_len=SEQ_LEN // 2, dtype="fp32")
    share = ParallelConfig(tp=1, pp=1, dp=2, micro_batch_size=2, num_microbatches=1, schedule="1f1b", cp=2).batch_share(2)
    assert share == 0.5
    for w, h in zip(whole.blocks, held.blocks, strict=True):
        flops = [sum(op.count * op.flops for op in b.ops if op.tp == "expert") for b in (w, h)]
        assert flops[0] * share == pytest.approx(flops[1]), (w.name, flops)
    sent = [p.extra["experts"]["block_dispatch_bytes"] for p in (whole, held)]
    assert any(sent[0]) and [s * share for s in sent[0]] == pytest.approx(sent[1])


def test_mixtral_8x7b_on_64_h100_takes_cp2_and_the_search_weighs_cp():
    """The published combination (Mixtral-8x7B, capacity routing, cp 2 with ep 8) is planned, with
    the note; unpinned, the search weighs cp against the plans without it (its note compares them)."""
    common = ["--model", "mixtral-8x7b", "--cluster", "8x8xH100-80GB", "--global-batch", "256", "--seq-len", "8192",
              "--json"]
    pinned = run_main("suggest", *common, "--cp", "2", "--ep", "8", "--top", "1")
    assert pinned.returncode == 0, pinned.stderr
    best = json.loads(pinned.stdout)["plans"][0]
    assert (best["cp"], best["ep"]) == (2, 8) and any(NOTE in note for note in best["notes"]), best["notes"]
    free = run_main("suggest", *common)
    assert free.returncode == 0, free.stderr
    notes = " ".join(json.loads(free.stdout)["search"]["notes"])
    assert "cp 1: the best plan with context parallelism (" in notes, notes
