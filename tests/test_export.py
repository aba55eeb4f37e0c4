"""What every export target shares (autoplan/report/export): refusals in one line with exit 2, the
`--allow-approx` contract (every difference at the top of the file and on stderr), the stage and
model-shape helpers. Each target's own checks, with the target's code, are in test_export_<target>.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from export_cases import CASES, GPT, SMALL_LLAMA, case

from autoplan.report.export import (
    EXPORT_TARGETS,
    ExportError,
    export_plan,
    model_shape,
    stage_layer_counts,
    stage_layer_ranges,
)

ROOT = Path(__file__).resolve().parent.parent


def _autoplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_unknown_targets_and_non_plans_are_refused_in_one_line():
    with pytest.raises(ExportError, match="unknown export target 'nemo'; use one of torchtitan, megatron, deepspeed"):
        export_plan(case("gpt"), "nemo")
    with pytest.raises(ExportError, match="takes a Plan"):
        export_plan({"tp": 1}, "megatron")


@pytest.mark.parametrize("target", list(EXPORT_TARGETS))
@pytest.mark.parametrize("name", CASES)
def test_an_export_is_exact_refused_or_approximate_with_every_difference_on_top(target, name):
    """Per (target, case): either the target states the plan exactly (no differences), or it refuses
    without --allow-approx in one line that names the way out, and with it lists every difference
    before the configuration itself starts."""
    plan = case(name)
    try:
        exact = export_plan(plan, target)
    except ExportError as refusal:
        message = str(refusal)
        assert "\n" not in message and message
        try:
            approx = export_plan(plan, target, allow_approx=True)
        except ExportError as again:  # no nearest config at all (a model the target lacks): same words
            assert str(again) == message
            # --allow-approx only ever comes with another target the refusal names (export_plan's advice)
            assert f"--to {target}" not in message
            assert message.count("--allow-approx") == len(re.findall(r"--to \w+ --allow-approx", message))
            return
        assert "--allow-approx" in message and approx.differences
        assert approx.differences[0] in message
        head = approx.text[: len(approx.text) // 2 + 200]
        for difference in approx.differences:
            assert difference in head or difference.replace('"', '\\"') in head, (target, name, difference)
        return
    assert exact.differences == () and exact.target == target and exact.text and exact.command


def test_stage_layers_follow_the_cuts():
    plan = case("empty-last-stage")
    assert stage_layer_counts(plan) == [2, 3, 3, 0]
    assert [list(r) for r in stage_layer_ranges(plan)] == [[0, 1], [2, 3, 4], [5, 6, 7], []]
    interleaved = case("interleaved-uneven")
    assert sum(stage_layer_counts(interleaved)) == 12 and len(interleaved.stages) == 6


def test_model_shapes_from_zoo_presets_specs_and_hugging_face_configs(tmp_path):
    llama = model_shape(case("preset-llama3-8b"))
    assert (llama.family, llama.preset, llama.num_layers, llama.hidden_size, llama.num_kv_heads,
            llama.ffn_hidden_size, llama.vocab_size, llama.rope_theta, llama.tie_embeddings) == (
        "llama", "llama3-8b", 32, 4096, 8, 14336, 128256, 500000.0, False)
    small = model_shape(case("default"))
    assert (small.preset, small.num_heads, small.num_kv_heads, small.hidden_size) == (None, 4, 2, 256)
    assert SMALL_LLAMA.startswith("llama:") and GPT.startswith("gpt:")
    gpt = model_shape(case("gpt"))
    assert (gpt.family, gpt.tie_embeddings, gpt.rope_theta, gpt.ffn_hidden_size) == ("gpt", True, None, 1024)

    import autoplan
    pytest.importorskip("transformers")
    hf = autoplan.suggest("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                          "intermediate_size=160,vocab_size=300", "1x2xA100-80GB", global_batch=4, seq_len=64)[0]
    shape = model_shape(hf)
    assert (shape.family, shape.hf_model_type, shape.num_layers, shape.num_kv_heads, shape.ffn_hidden_size,
            shape.vocab_size) == ("llama", "llama", 2, 2, 160, 300)
    bert = autoplan.suggest("hf:bert:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,"
                            "vocab_size=300", "1x2xA100-80GB", global_batch=4, seq_len=64)[0]
    assert model_shape(bert) is None  # not a decoder any target's model definition has: each target refuses


@pytest.mark.slow
def test_the_cli_refuses_with_exit_2_and_writes_nothing_then_allow_approx_lists_every_difference(tmp_path):
    """The user's path: `suggest --out`, `export --to X --out F` (refused: exit 2, one line, no file),
    `export --allow-approx` (exit 0, each difference on stderr and at the top of F, the run command)."""
    plan = tmp_path / "p.json"
    done = _autoplan("suggest", "--model", SMALL_LLAMA, "--cluster", "1x4xA100-80GB", "--global-batch", "16",
                     "--seq-len", "512", "--pp", "4", "--tp", "1", "--dp", "1", "--schedule", "zb-h1", "--out",
                     str(plan), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for target in EXPORT_TARGETS:
        out = tmp_path / f"{target}.out"
        refused = _autoplan("export", str(plan), "--to", target, "--out", str(out), cwd=tmp_path)
        if refused.returncode == 0:  # this target runs zb-h1 as planned: nothing to approximate
            assert "approximate:" not in refused.stderr and "run it: " in refused.stderr
            continue
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "--allow-approx" in lines[0] and "Traceback" not in refused.stderr
        assert not out.exists()
        approx = _autoplan("export", str(plan), "--to", target, "--out", str(out), "--allow-approx", cwd=tmp_path)
        assert approx.returncode == 0, approx.stderr
        listed = [line.removeprefix("approximate: ") for line in approx.stderr.splitlines()
                  if line.startswith("approximate: ")]
        assert listed and "run it: " in approx.stderr
        plural = "s" if len(listed) > 1 else ""
        assert f"({len(listed)} difference{plural} from the plan, listed at its top)" in approx.stderr
        text = out.read_text()
        for difference in listed:
            assert difference[:60] in text[: len(text) // 2 + 200]


def test_a_model_file_plan_is_refused_by_the_targets_that_lack_its_model():
    """A model file (the repo's example) has no counterpart in torchtitan's or Megatron's model
    definitions: no nearest config exists, so even --allow-approx refuses, in one line."""
    import autoplan

    plan = autoplan.suggest(f"{ROOT / 'examples' / 'custom_model.py'}:build", "1x2xA100-80GB", global_batch=8,
                            seq_len=64)[0]
    assert model_shape(plan) is None
    for target in ("torchtitan", "megatron"):
        with pytest.raises(ExportError) as refusal:
            export_plan(plan, target, allow_approx=True)
        assert "\n" not in str(refusal.value) and "--allow-approx" not in str(refusal.value)
