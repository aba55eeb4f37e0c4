"""Sequence parallelism for mixture-of-experts layers (issue 31): under tp > 1 with
sequence_parallel, the MoE block takes the whole sequence like the MLP does and keeps its slice of
the output ([Note: sequence parallelism] in runtime/parallel/tensor_parallel.py). Through `autoplan.partition`
on 4 gloo ranks against one process (the loss, every gradient, the parameters after two AdamW
steps), and through `autoplan suggest --sequence-parallel --out` / `autoplan run`."""

from __future__ import annotations

import pytest
from test_expert_zero1 import _check, _plan, suggest_and_run


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
    plan = suggest_and_run(tmp_path, "--tp", "2", "--dp", "2", "--ep", "1", "--sequence-parallel")
    assert plan["sequence_parallel"] is True and plan["tp"] == 2
