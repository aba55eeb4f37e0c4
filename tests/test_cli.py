"""The `autoplan` console script: real entry point, real output, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoplan.cli import main

SMALL = "gpt:num_layers=4,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=256"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=240)


def test_suggest_default_plans_a_builtin_model():
    result = run_cli("suggest", "--top", "2")
    assert result.returncode == 0, result.stderr
    assert "llama3-8b" in result.stdout and "MFU" in result.stdout and "best plan is bound by" in result.stdout


def test_suggest_json_and_out(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["suggest", "--model", SMALL, "--cluster", "1x4xA100-80GB", "--global-batch", "16", "--seq-len", "256",
                 "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"plans", "search"} and data["search"]["configs_evaluated"] > 0
    plan = data["plans"][0]
    for key in ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "schedule", "virtual_stages", "recompute",
                "zero", "sequence_parallel", "stages", "fits"):
        assert key in plan
    assert set(plan["predicted"]) >= {"step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                                      "mfu", "peak_memory_bytes", "bubble_fraction"}
    assert json.loads(out.read_text())["tp"] == plan["tp"]


def test_profile_json(capsys):
    assert main(["profile", "--model", SMALL, "--seq-len", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["kind"] for b in data["blocks"]] == ["embedding"] + ["layer"] * 4 + ["norm", "head"]


@pytest.mark.parametrize("args", [
    ["profile", "--model", "lama3-8b"],
    ["profile", "--model", "gpt:num_layers"],
    ["profile", "--model", "llama3-8b:num_layer=2"],
    ["profile", "--model", "no/such/file.py:build"],
    ["profile", "--model", SMALL, "--seq-len", "100000"],
    ["profile", "--model", SMALL, "--device", "tpu"],
    ["suggest", "--cluster", "8xH100"],
    ["suggest", "--cluster", "2x8xNOPE"],
    ["suggest", "--cluster", "missing.yaml"],
    ["suggest", "--tp", "3"],
    ["suggest", "--global-batch", "0"],
    ["suggest", "--model", "llama3-405b", "--cluster", "1x8xA100-80GB"],
])
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan: error:") and "\n" not in err and "Traceback" not in err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "suggest" in capsys.readouterr().out


# The modules that made `autoplan --help` take 1.4 s on a quiet machine and 6-7 s on a loaded one
# (issue 29): none of them is needed to parse a command line.
HEAVY_MODULES = ("torch", "networkx", "rich", "yaml", "pulp", "numpy", "transformers")


def test_help_and_version_import_nothing_heavy():
    """`autoplan --help`, `--version` and every subcommand's `--help`, run as the console script runs
    them, in a fresh interpreter: the planner's heavy dependencies stay unloaded."""
    script = (
        "import sys\n"
        "from autoplan.cli import build_parser, main\n"
        "commands = [name for action in build_parser()._subparsers._group_actions for name in action.choices]\n"
        "assert {'suggest', 'run', 'show', 'export'} <= set(commands), commands\n"
        "for argv in [['--help'], ['--version']] + [[c, '--help'] for c in commands]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "autoplan 0.1.0" in result.stdout and "--global-batch" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_public_api_names_import_lazily():
    """`import autoplan` loads nothing heavy; every name in `__all__` still imports (PEP 562)."""
    script = (
        "import sys, autoplan\n"
        "assert 'torch' not in sys.modules\n"
        "for name in autoplan.__all__:\n"
        "    exec(f'from autoplan import {name}')\n"
        "assert autoplan.suggest.__module__ == 'autoplan.api' and autoplan.Plan.__name__ == 'Plan'\n"
        "assert set(autoplan.__all__) <= set(dir(autoplan))\n"
        "try:\n"
        "    autoplan.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no attribute 'no_such_name'" in result.stdout


def test_console_script_exit_keeps_output_files_and_codes(tmp_path):
    """`suggest` ends with os._exit (no interpreter teardown, issue 29): everything printed and the
    --out file are still complete, and a refusal still exits 2 with its one line."""
    out = tmp_path / "plan.json"
    result = run_cli("suggest", "--model", SMALL, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--seq-len", "64",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert " ".join(result.stdout.split()).endswith(f"run it with `autoplan run {out}`")  # the last line, whole
    plan = json.loads(out.read_text())
    assert plan["tp"] * plan["pp"] * plan["dp"] == 2
    refused = run_cli("suggest", "--model", SMALL, "--cluster", "1x2xA100-80GB", "--global-batch", "8", "--tp", "3")
    assert refused.returncode == 2 and refused.stderr.startswith("autoplan: error:"), refused.stderr


def test_the_lazy_package_still_binds_its_subpackages():
    """`import autoplan; autoplan.runtime.partition` worked with the eager imports: it still does."""
    code = ("import autoplan; assert autoplan.runtime.partition is autoplan.partition; "
            "assert autoplan.cluster.parse_cluster; "
            "import sys; sys.exit(0 if not hasattr(autoplan, 'no_such_name') else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-800:]
