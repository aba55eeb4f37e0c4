"""What each published run states and what its prediction assumes (autoplan/published.py [Note: the
reduce dtype a published run implies], issue 40): printed by benchmarks/validate_published.py, and
the SC'21 runs priced without sequence parallelism, as they ran."""

from __future__ import annotations

import pytest
from _scripts import load_benchmark

from autoplan.published import SETTING_REASONS, load_runs, predict, run_settings


@pytest.fixture(scope="module")
def runs():
    return {r.id: r for r in load_runs()}


def test_every_assumption_names_a_reason_the_report_explains(runs):
    for run in runs.values():
        for name, _value, how in run_settings(run):
            assert how == "stated" or (how.startswith("assumed: ") and how[len("assumed: "):] in SETTING_REASONS), \
                (run.id, name, how)
    sc21 = run_settings(runs["sc21_18.4b"])
    assert ("sequence parallel", "off", "assumed: predates it") in sc21
    assert ("micro-batch", "?", "assumed: search's choice") in sc21
    assert ("reduce", "fp32", "assumed: stack default") in run_settings(runs["tt_a100_l3_8b_sel"])


def test_the_sc21_runs_are_priced_without_sequence_parallelism(runs):
    """Megatron-LM SC'21 predates sequence parallelism (Korthikanti et al. 2022): its tp 8 rows are
    priced with it off, which keeps the hidden-shaped activations whole on every tp rank."""
    import dataclasses

    run = runs["sc21_18.4b"]
    assert run.pins["tp"] == 8 and run.pins["sequence_parallel"] is False
    as_ran = predict(run, chosen={"micro_batch_size": 1, "virtual_stages": 1})
    assert as_ran.plan.sequence_parallel is False
    with_sp = predict(dataclasses.replace(run, pins={**run.pins, "sequence_parallel": True}),
                      chosen={"micro_batch_size": 1, "virtual_stages": 1})
    assert with_sp.plan.sequence_parallel is True
    assert with_sp.plan.predicted.peak_memory_bytes < as_ran.plan.predicted.peak_memory_bytes


def test_the_report_prints_what_each_run_states_and_assumes(runs, capsys):
    """benchmarks/validate_published.py's table of settings, as a user reads it."""

    module = load_benchmark("validate_published")
    qwen = runs["zoo_q235_tp2_ep8_fsdp"]
    line = module._settings_line(predict(qwen))
    assert "reduce fp32 (assumed: stack default)" in line and "stack megatron-core-deepep (stated)" in line
