"""Sequence parallelism for mixture-of-experts layers (issue 31): under tp > 1 with
sequence_parallel, the MoE block takes the whole sequence like the MLP does and keeps its slice of
the output ([Note: sequence parallelism] in runtime/tensor_parallel.py). Through `autoplan.partition`
on 4 gloo ranks against one process (the loss, every gradient, the parameters after two AdamW
steps), and through `autoplan suggest --sequence-parallel --out` / `autoplan run`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_expert_zero1 import GLOBAL_BATCH, MICRO_BATCH, SEQ, SPEC, STEPS, _check, _plan, _reference

import autoplan


def _sp_plan(**pins):
    plan = _plan(sequence_parallel=True, **pins)
    assert plan.sequence_parallel and plan.tp == 2, plan
    return plan


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_moe_at_tp_2_with_sequence_parallelism_matches_a_single_process():
    _check({"tp2-sp": _sp_plan(tp=2, pp=1, dp=2, ep=1)})


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_moe_sequence_parallelism_with_ep_2_and_across_a_pipeline_cut_matches_a_single_process():
    """ep 2 x tp 2 (expert parallelism inside a sequence-parallel layer) and tp 2 x pp 2 (the
    sequence slice crosses the cut between the two MoE layers)."""
    _check({"ep2-tp2-sp": _sp_plan(tp=2, pp=1, dp=2, ep=2), "tp2-pp2-sp": _sp_plan(tp=2, pp=2, dp=1, ep=1)})


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(200)
def test_suggest_then_run_moe_with_sequence_parallelism_prints_the_single_process_losses(tmp_path):
    plan_file = tmp_path / "plan.json"
    result = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", SPEC, "--cluster", "1x4xcpu",
                             "--global-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ), "--dtype", "fp32",
                             "--micro-batch-size", str(MICRO_BATCH), "--tp", "2", "--dp", "2", "--ep", "1",
                             "--sequence-parallel", "--out", str(plan_file)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(plan_file.read_text())["sequence_parallel"] is True
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(plan_file), "--nproc", "4", "--steps", str(STEPS)],
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [float(line.split()[3]) for line in run.stdout.splitlines() if line.startswith("step ")]
    losses, _, _ = _reference(autoplan.Plan.load(plan_file))
    assert printed == pytest.approx(losses, abs=2e-4), (printed, losses)
