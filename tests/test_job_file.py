"""The job file of `autoplan run` (runtime/launcher/job_file.py): docs/training.md's full example parses into
the run's settings, flags given on the command line override it, and an unknown key or a wrong type
is one line (exit 2, before torch loads) naming it and what is known. A run from a job file is in
tests/test_train_real_run.py (the default-tier dp 2 test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cli import build_parser
from autoplan.runtime.launcher.job_file import KEYS, RUN_DEFAULTS, load_job, merge_run_args

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _doc_example() -> str:
    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/training.md: one full job-file example"
    return blocks[0]


def test_the_documented_example_parses_into_every_setting(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(_doc_example())
    values = load_job(job)
    assert values["plan"] == str(tmp_path / "p.json")  # relative to the job file's directory
    assert values["data"] == str(tmp_path / "data" / "train.bin")
    assert values["checkpoint_dir"] == str(tmp_path / "checkpoints")
    assert values["betas"] == (0.9, 0.95) and values["lr_schedule"] == "cosine" and values["warmup_steps"] == 100
    assert values["eval_every"] == 100 and values["eval_batches"] == 20 and values["clip_grad"] == 1.0
    # Every key the file format knows is in the example (commented keys aside), and each is a run setting.
    documented = {key.dest for section in KEYS.values() for key in section.values()}
    assert documented - set(values) == {"plan_index", "model", "init"}
    assert documented <= set(RUN_DEFAULTS) | {"plan"}
    # ... and each stands for a flag `autoplan run` has.
    run_flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["run"]._actions}
    assert documented <= run_flags


def _run_args(*argv: str):
    return merge_run_args(build_parser().parse_args(["run", *argv]))


def test_command_line_flags_override_the_file_and_defaults_fill_the_rest(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nplan = "p.json"\n[training]\nsteps = 50\nseed = 3\n[optimizer]\nlr = 0.01\n')
    args = _run_args("--config", str(job), "--steps", "10", "--lr", "0.001")
    assert (args.steps, args.lr, args.seed) == (10, 0.001, 3)  # --steps 10, the default's value, still overrides
    assert args.plan == str(tmp_path / "p.json") and args.weight_decay == RUN_DEFAULTS["weight_decay"]
    positional = _run_args(str(job))  # `autoplan run job.toml`
    assert positional.plan == str(tmp_path / "p.json") and positional.steps == 50
    other = _run_args("other.json", "--config", str(job))  # a plan on the command line wins
    assert other.plan == "other.json"
    plain = _run_args("p.json")
    assert plain.steps == 10 and plain.resume is False and plain.betas == (0.9, 0.999)


@pytest.mark.parametrize("text, message", [
    ("[optimizer]\nwarmup_steps = 5\n",
     "unknown key 'warmup_steps' in [optimizer]; known: lr, betas, eps, weight_decay, no_decay_embeddings"),
    ("[optimiser]\nlr = 1\n", "unknown section [optimiser]; known: [job], [training], [optimizer]"),
    ("[training]\nsteps = 1.5\n", "[training] steps = 1.5 must be an integer (as --steps)"),
    ("[optimizer]\nbetas = 0.9\n", "[optimizer] betas = 0.9 must be two numbers"),
    ("[checkpoint]\nresume = 1\n", "[checkpoint] resume = 1 must be true or false (as --resume)"),
    ("steps = 3\n", "unknown section [steps]"),
    ("[training\n", "not TOML"),
])
def test_a_bad_job_file_is_one_line_naming_the_key(tmp_path, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    with pytest.raises(ValueError) as caught:
        load_job(job)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_a_bad_job_file_exits_2_through_the_cli(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nplan = "p.json"\n[lr_scheduler]\nwarmup = 10\n')
    ran = subprocess.run([sys.executable, "-m", "autoplan", "run", str(job)], capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 2, ran.stderr
    assert "unknown key 'warmup' in [lr_scheduler]; known: schedule, warmup_steps, decay_steps, min_lr" in ran.stderr
    assert "Traceback" not in ran.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text("[training]\nsteps = 2\n")
    ran = subprocess.run([sys.executable, "-m", "autoplan", "run", "--config", str(empty)], capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 2 and "autoplan run needs a plan" in ran.stderr, ran.stderr
