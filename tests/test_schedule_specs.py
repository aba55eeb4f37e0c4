"""Schedules as data (issue 42): every schedule has one spec, naming what each export target runs,
and the search, the memory count and the exports read it."""

from __future__ import annotations

import pytest

from autoplan.report.export import EXPORT_TARGETS
from autoplan.schedule import SCHEDULE_SPECS, SCHEDULES, make_schedule, schedule_spec, simulate
from autoplan.schedule.specs import EXPORTED_TO
from autoplan.search.inflight import schedule_inflight


def test_every_schedule_has_a_spec_naming_every_export_target():
    assert tuple(SCHEDULE_SPECS) == SCHEDULES
    assert set(EXPORTED_TO) == set(EXPORT_TARGETS)
    for name, spec in SCHEDULE_SPECS.items():
        assert spec.name == name
        assert set(spec.exports) == set(EXPORT_TARGETS), (name, set(EXPORT_TARGETS) ^ set(spec.exports))
        assert spec.held in ("all", "depth", "pipeline", "interleaved", "simulate"), name
    with pytest.raises(ValueError, match="unknown schedule 'zbv'"):
        schedule_spec("zbv")


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_specs_structure_is_its_schedules(name):
    """split_backward: it has W actions; looped: it needs several stages per rank; held: the
    micro-batches in flight its closed form gives are what the simulator finds."""
    spec = schedule_spec(name)
    pp, m, v = 4, 8, 2 if spec.looped else 1
    if spec.looped:
        with pytest.raises(ValueError):
            make_schedule(name, pp, m, 1)
    schedule = make_schedule(name, pp, m, v)
    kinds = {action.kind.name for rank in schedule.actions for action in rank}
    assert ("W" in kinds) == spec.split_backward
    assert schedule_inflight(name, pp, m, v) == tuple(simulate(schedule, lambda a: 1.0).peak_inflight)


def test_a_schedule_an_export_target_lacks_is_listed_as_a_difference(tmp_path):
    """Through the CLI: a zb-h1 plan exported to each target lists the target's line from the spec."""
    import json

    from tests._cli import run_main

    plan = tmp_path / "zb.json"
    result = run_main("suggest", "--model", "llama:num_layers=4,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=64",
                      "--cluster", "1x2xcpu", "--global-batch", "8", "--seq-len", "64", "--pp", "2", "--schedule",
                      "zb-h1", "--dtype", "fp32", "--out", str(plan))
    assert result.returncode == 0, result.stderr
    assert json.loads(plan.read_text())["schedule"] == "zb-h1"
    for target, runs in schedule_spec("zb-h1").exports.items():
        out = tmp_path / f"zb.{target}"
        result = run_main("export", str(plan), "--to", target, "--out", str(out), "--allow-approx")
        assert result.returncode == 0, result.stderr
        line = runs.difference.format(name=runs.name)
        assert line[:60] in " ".join(out.read_text().split()), (target, line)
