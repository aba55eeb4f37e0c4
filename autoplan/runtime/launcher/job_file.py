"""A job file for `autoplan run` (`load_job`, `merge_run_args`): one TOML file that records the plan,
the model, the data, the optimizer and its schedule, the steps, the checkpoints and the evaluation,
so a run is one command (`autoplan run --config job.toml`, or `autoplan run job.toml`), as
torchtitan's `--job.config_file train.toml` is. A flag given on the command line overrides the
file; what neither gives takes `RUN_DEFAULTS`.

Every key is one of `KEYS` (section -> key -> the `run` flag it stands for); an unknown section or
key, or a value of the wrong type, is one line naming it and what is known (a misspelt
`warmup_step` must not silently train without warmup). Relative paths in the file are relative to
the file's directory, so a job file runs from anywhere. docs/training.md has a full example.

Only the standard library (tomllib, Python 3.11; tomli, its backport, on 3.10) here: `autoplan run` reads the file before torch loads.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KEYS", "RUN_DEFAULTS", "JobKey", "load_job", "merge_run_args"]


@dataclass(frozen=True)
class JobKey:
    """A key of the job file: the `run` flag's destination, its type, whether it is a path."""

    dest: str
    kind: str
    """"int", "float", "str", "bool" or "betas" (two numbers)."""
    path: bool = False

    @property
    def flag(self) -> str:
        return "--" + {"checkpoint_dir": "checkpoint-dir"}.get(self.dest, self.dest.replace("_", "-"))


KEYS: dict[str, dict[str, JobKey]] = {
    "job": {"plan": JobKey("plan", "str", path=True), "plan_index": JobKey("plan_index", "int"),
            "model": JobKey("model", "str"), "init": JobKey("init", "str", path=True),
            "nproc": JobKey("nproc", "int"), "timeout": JobKey("timeout", "float"),
            "allow_oversubscribe": JobKey("allow_oversubscribe", "bool")},
    "training": {"steps": JobKey("steps", "int"), "seed": JobKey("seed", "int"),
                 "data": JobKey("data", "str", path=True), "clip_grad": JobKey("clip_grad", "float"),
                 "skip_nonfinite": JobKey("skip_nonfinite", "int")},
    "optimizer": {"lr": JobKey("lr", "float"), "betas": JobKey("betas", "betas"), "eps": JobKey("eps", "float"),
                  "weight_decay": JobKey("weight_decay", "float"),
                  "no_decay_embeddings": JobKey("no_decay_embeddings", "bool")},
    "lr_scheduler": {"schedule": JobKey("lr_schedule", "str"), "warmup_steps": JobKey("warmup_steps", "int"),
                     "decay_steps": JobKey("decay_steps", "int"), "min_lr": JobKey("min_lr", "float")},
    "checkpoint": {"dir": JobKey("checkpoint_dir", "str", path=True), "every": JobKey("checkpoint_every", "int"),
                   "resume": JobKey("resume", "bool"), "overwrite": JobKey("overwrite", "bool")},
    "eval": {"every": JobKey("eval_every", "int"), "data": JobKey("eval_data", "str", path=True),
             "batches": JobKey("eval_batches", "int")},
    "metrics": {"path": JobKey("metrics", "str", path=True), "trace": JobKey("trace", "str", path=True)},
}
"""Section -> key -> the flag it stands for (`autoplan run --help` says what each does)."""

RUN_DEFAULTS: dict[str, Any] = {
    "plan_index": None, "model": None, "init": None, "nproc": None, "timeout": 60.0, "allow_oversubscribe": False,
    "steps": 10, "seed": 0, "data": None, "clip_grad": None, "skip_nonfinite": 0,
    "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "no_decay_embeddings": False,
    "lr_schedule": "constant", "warmup_steps": 0, "decay_steps": None, "min_lr": 0.0,
    "checkpoint_dir": None, "checkpoint_every": None, "resume": False, "overwrite": False,
    "eval_every": None, "eval_data": None, "eval_batches": 10, "metrics": None, "trace": None,
}
"""What `autoplan run` uses where neither the command line nor the job file says (the optimizer's:
optim_config.py `OptimizerConfig`)."""


def _typed(where: str, key: JobKey, value: Any) -> Any:
    def wrong(expected: str) -> ValueError:
        return ValueError(f"{where} = {value!r} must be {expected} (as {key.flag})")

    if key.kind == "bool":
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if key.kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise wrong("an integer")
        return value
    if key.kind == "float":
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise wrong("a number")
        return float(value)
    if key.kind == "betas":
        if not (isinstance(value, list) and len(value) == 2
                and all(isinstance(b, int | float) and not isinstance(b, bool) for b in value)):
            raise wrong("two numbers, e.g. [0.9, 0.95]")
        return (float(value[0]), float(value[1]))
    if not isinstance(value, str) or not value.strip():
        raise wrong("a non-empty string")
    return value


def _resolve(value: str, base: Path) -> str:
    """A path of the file, relative to the file's directory; `file.py:function` by its file."""
    path, sep, function = value.rpartition(":") if ".py:" in value else (value, "", "")
    if Path(path).expanduser().is_absolute():
        return value
    return str(base / path) + sep + function


def load_job(path: str | Path) -> dict[str, Any]:
    """The run's settings a job file gives: {dest: value} (see `KEYS`); ValueError with one line for
    a file that does not read, parse, or holds an unknown key or a wrong type."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("job files need Python 3.11 (tomllib) or `pip install tomli` on 3.10") from None
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--config {str(path)!r} cannot be read ({exc.strerror or exc}); give a job file "
                         "(TOML, docs/training.md)") from None
    try:
        document = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: not TOML: {str(exc).splitlines()[0]}") from None
    base = path.resolve().parent
    out: dict[str, Any] = {}
    for section, table in document.items():
        known = KEYS.get(section)
        if known is None:
            raise ValueError(f"--config {path}: unknown section [{section}]; known: "
                             f"{', '.join(f'[{s}]' for s in KEYS)}")
        if not isinstance(table, dict):
            raise ValueError(f"--config {path}: {section} must be a section [{section}], got a value")
        for name, value in table.items():
            key = known.get(name)
            if key is None:
                raise ValueError(f"--config {path}: unknown key {name!r} in [{section}]; known: {', '.join(known)}")
            value = _typed(f"--config {path}: [{section}] {name}", key, value)
            out[key.dest] = _resolve(value, base) if key.path else value
    return out


def merge_run_args(args: argparse.Namespace) -> argparse.Namespace:
    """`autoplan run`'s settings: each flag given on the command line (not None), else the job
    file's (`args.config`, or the positional argument when it names a .toml file), else
    `RUN_DEFAULTS`. Returns a new Namespace; ValueError for a run without a plan."""
    values = dict(vars(args))
    config = values.get("config")
    if config is None and isinstance(values.get("plan"), str) and values["plan"].endswith(".toml"):
        config, values["plan"] = values["plan"], None
    job = load_job(config) if config is not None else {}
    for dest, value in job.items():
        if values.get(dest) is None:
            values[dest] = value
    for dest, value in RUN_DEFAULTS.items():
        if values.get(dest) is None:
            values[dest] = value
    if values.get("plan") is None:
        raise ValueError("autoplan run needs a plan: `autoplan run PLAN.json`, or plan = \"PLAN.json\" under [job] "
                         "in the --config job file")
    values["config"] = config
    return argparse.Namespace(**values)
