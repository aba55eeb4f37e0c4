"""`autoplan suggest --target torchtitan|megatron|deepspeed` (issue 43, item 1): the search keeps
only plans the target runs as planned, so `autoplan export --to` it is exact; what the target cannot
run is said once, by the exporter (`mismatches`, search/targets.py [Note: searching for an export
target])."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from export_cases import CASES, case

import autoplan
from autoplan.api import suggest_with_stats
from autoplan.report.export import EXPORT_TARGETS, ExportError, deepspeed, export_plan, megatron, torchtitan
from autoplan.search.configs import NoPlanError
from autoplan.search.targets import TARGETS

SMALL_LLAMA = "llama:num_layers=12,hidden_size=256,num_heads=4,num_kv_heads=2,vocab_size=32000,max_seq_len=512"
JOB = ("--cluster", "1x8xA100-80GB", "--global-batch", "32", "--seq-len", "512")
EXPORTERS = {"torchtitan": torchtitan, "megatron": megatron, "deepspeed": deepspeed}


def _autoplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def _suggest_then_export(target: str, model: str, job: tuple[str, ...], tmp_path: Path, *pins: str):
    suggest = _autoplan("suggest", "--model", model, *job, "--top", "3", "--target", target, *pins, "--out",
                        "p.json", cwd=tmp_path)
    if suggest.returncode != 0:
        return suggest, None
    export = _autoplan("export", "p.json", "--to", target, "--out", f"out.{target}", cwd=tmp_path)
    return suggest, export


def _assert_exact(export: subprocess.CompletedProcess, target: str, tmp_path: Path) -> None:
    assert export.returncode == 0, export.stderr
    text = (tmp_path / f"out.{target}").read_text()
    assert "DIFFERENCES" not in text and "cannot run" not in export.stderr
    if target == "deepspeed":
        assert json.loads(text)["_autoplan_differences"] == []


# ---- through the CLI, a small model ------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_suggest_for_a_target_writes_a_plan_it_exports_exactly(target, tmp_path):
    suggest, export = _suggest_then_export(target, SMALL_LLAMA, JOB, tmp_path)
    assert suggest.returncode == 0, suggest.stderr
    assert f"not run by {target} as planned" in suggest.stdout
    _assert_exact(export, target, tmp_path)


def test_every_plan_listed_exports_exactly_and_the_filter_drops_some(tmp_path):
    """Each of the top plans (not only the best) is exact for its target, and for each target the
    unfiltered search's top plans hold one it would not run as planned (so the filter is doing the
    work, not luck)."""
    for target in TARGETS:
        plans = autoplan.suggest(SMALL_LLAMA, "1x8xA100-80GB", global_batch=32, seq_len=512, top=4, target=target)
        assert plans
        for plan in plans:
            assert export_plan(plan, target).differences == ()
    plain = autoplan.suggest(SMALL_LLAMA, "1x8xA100-80GB", global_batch=32, seq_len=512, top=4)
    for target in TARGETS:
        refused = []
        for plan in plain:
            try:
                export_plan(plan, target)
            except ExportError:
                refused.append(plan)
        assert refused, target


def test_the_search_counts_the_targets_drops_as_their_own_reason():
    result, _ = suggest_with_stats(SMALL_LLAMA, "1x8xA100-80GB", global_batch=32, seq_len=512, target="deepspeed",
                                   explain=True)
    search = result.to_dict()["search"]
    assert search["rejected"]["target"] > 0
    kept = [r for r in search["rejections"] if r["reason"] == "target"]
    assert kept and all(r["why"].startswith("deepspeed: ") for r in kept)


def test_a_pin_the_target_cannot_run_is_one_line_naming_the_dimension(tmp_path):
    run = _autoplan("suggest", "--model", SMALL_LLAMA, *JOB, "--target", "torchtitan", "--pp", "2", "--schedule",
                    "zb-h1", cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert lines[0].startswith("autoplan: error: no plan runs on torchtitan as planned") and "pp x schedule" in lines[0]


@pytest.mark.parametrize(("target", "pins", "named"), [
    ("deepspeed", dict(cp=2), "for cp ("),
    ("megatron", dict(pp=2, schedule="gpipe"), "for pp x schedule ("),
    ("torchtitan", dict(zero=1, dp=8), "for zero ("),
])
def test_each_targets_pins_it_cannot_run(target, pins, named):
    with pytest.raises(NoPlanError, match=f"^no plan runs on {target} as planned: .*{re.escape(named)}"):
        autoplan.suggest(SMALL_LLAMA, "1x8xA100-80GB", global_batch=32, seq_len=512, target=target, **pins)


def test_a_model_the_target_cannot_build_is_refused_before_the_search():
    gpt = "gpt:num_layers=4,hidden_size=128,num_heads=4,vocab_size=1024,max_seq_len=256"
    with pytest.raises(NoPlanError, match="^no plan of .* runs on torchtitan as planned: torchtitan has no model "
                       ".*depends on the model.*choose another --target$"):
        autoplan.suggest(gpt, "1x8xA100-80GB", global_batch=32, seq_len=256, target="torchtitan")


def test_an_unknown_target_is_one_line():
    with pytest.raises(ValueError, match="unknown --target 'jax'; use one of torchtitan, megatron, deepspeed"):
        autoplan.suggest(SMALL_LLAMA, "1x8xA100-80GB", global_batch=32, seq_len=512, target="jax")


def test_an_export_refusal_names_the_target_search():
    plan = case("zb-h1")
    for target in TARGETS:
        with pytest.raises(ExportError, match=f"`autoplan suggest --target {target}` searches only plans {target} "
                           "runs as planned, or pass --allow-approx"):
            export_plan(plan, target)


# ---- one source of truth -----------------------------------------------------------------------

_CUT_DIFFERENCES = ("stage cuts", "the plan puts the final norm")


@pytest.mark.parametrize("name", CASES)
def test_the_search_filter_is_what_the_export_says(name):
    """Every difference `write` lists that does not depend on the cuts is one `mismatches` finds
    (and nothing else), and a configuration `mismatches` refuses is one `write` refuses."""
    plan = case(name)
    for target, module in EXPORTERS.items():
        found = module.mismatches(plan)
        refusal = next((m for m in found if m.error is not None), None)
        try:
            export = EXPORT_TARGETS[target](plan)
        except ExportError as exc:
            assert refusal is not None and str(exc) == refusal.text, (name, target)
            continue
        assert refusal is None, (name, target)
        config_level = [d for d in export.differences if not d.startswith(_CUT_DIFFERENCES)]
        # the same sentences; without cuts, DeepSpeed's merged stages cannot say their block counts
        assert [_no_cuts(d) for d in config_level] == [_no_cuts(m.text) for m in found], (name, target)


def _no_cuts(text: str) -> str:
    return re.sub(r" \(rank 0: [^)]*\)", "", text)


# ---- the issue's jobs ----------------------------------------------------------------------------

# (model, cluster, global batch, seq len); the clusters as the README spells them.
JOBS = {
    "llama3-70b": ("llama3-70b", "8x8xH100-80GB", 512, 4096),
    "mixtral-8x7b": ("mixtral-8x7b", "8x8xH100-80GB", 256, 4096),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", "8x8xH100-80GB", 256, 4096),
    "gpt3-175b": ("gpt3-175b", "128x8xA100-80GB", 1536, 2048),
}
# What no plan of the target can avoid, where that is the answer: the model itself (torchtitan
# routes experts dropless with no Switch balancing loss, and has no GPT-2 family model).
REFUSED = {
    ("mixtral-8x7b", "torchtitan"): "capacity factor",
    ("qwen3-30b-a3b", "torchtitan"): "capacity factor",
    ("gpt3-175b", "torchtitan"): "torchtitan has no model",
}
# Measured on the 2 shared cores (`time autoplan suggest ... --target X`): llama3-70b 11-17 s a
# target, of which the search is 3-5 s; the MoE jobs 7-24 s; gpt3-175b 7-19 s. One case stays in
# the default tier, the rest are extended.
_CASES = [pytest.param(job, target, id=f"{job}-{target}",
                       marks=() if (job, target) == ("llama3-70b", "torchtitan") else pytest.mark.extended)
          for job in JOBS for target in TARGETS]


@pytest.mark.parametrize(("job", "target"), _CASES)
def test_the_issue_jobs_export_exactly_or_refuse_in_one_line(job, target, tmp_path):
    model, cluster, global_batch, seq_len = JOBS[job]
    args = ("--cluster", cluster, "--global-batch", str(global_batch), "--seq-len", str(seq_len))
    suggest, export = _suggest_then_export(target, model, args, tmp_path)
    if (job, target) in REFUSED:
        assert suggest.returncode == 2
        line = suggest.stderr.strip()
        assert len(line.splitlines()) == 1 and REFUSED[job, target] in line
        assert f"runs on {target} as planned" in line and "the model" in line
        return
    assert suggest.returncode == 0, suggest.stderr
    _assert_exact(export, target, tmp_path)


# ---- the export tier: the targets' own code reads a --target plan ---------------------------------

@pytest.mark.export
@pytest.mark.parametrize("target", TARGETS)
def test_the_targets_own_code_reads_a_target_plan(target, tmp_path, monkeypatch):
    """A `--target` plan of the small Llama, read by the target's own parser (the export tier's
    environment has torchtitan, megatron-core with Megatron-LM's arguments, and DeepSpeed)."""
    pytest.importorskip({"torchtitan": "torchtitan", "megatron": "megatron.core", "deepspeed": "deepspeed"}[target])
    plan = autoplan.suggest(SMALL_LLAMA, "1x8xA100-80GB", global_batch=32, seq_len=512, top=1, pp=2,
                            target=target)[0]
    export = export_plan(plan, target, filename=str(tmp_path / "autoplan_target_plan.py"))
    assert export.differences == ()
    if target == "torchtitan":
        from test_export_torchtitan import _parse

        config = _parse(export.text, tmp_path, "autoplan_target_plan")
        p = config.parallelism
        assert (p.tensor_parallel_degree, p.pipeline_parallel_degree) == (plan.tp, plan.pp)
        assert p.pipeline_parallel_schedule == {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}[plan.schedule]
        assert p.module_fqns_per_model_part is not None
    elif target == "megatron":
        from test_export_megatron import _parse, _sourced_args, _transformer_config

        config = _transformer_config(_parse(_sourced_args(export.text, tmp_path)))
        assert config.pipeline_model_parallel_size == plan.pp
    else:
        from deepspeed.runtime.config import DeepSpeedConfig
        from test_export_deepspeed import _fake_world, _pipeline_module

        monkeypatch.setenv("LOCAL_RANK", "0")
        path = tmp_path / "ds.json"
        path.write_text(export.text)
        pm = json.loads(export.text)["autoplan_pipeline_module"]
        with _fake_world(plan.num_gpus, plan.rank(0, 0, 0)):
            module = _pipeline_module(pm)
            assert [int(x) for x in module.parts] == list(plan.boundaries)
            config = DeepSpeedConfig(str(path), mpu=module.mpu())
        assert config.train_batch_size == plan.job.global_batch
