"""The on-disk format of a checkpoint, format "autoplan-checkpoint/2": a DCP checkpoint plus our
manifest, in one directory per step; the names of its files and of the state dict's keys.

Apart from the code that writes (save.py) and reads (reader.py, load.py) it, so that the format is
read in one place; integrity.py checks a directory against it.

    DIR/step-000123/__0_0.distcp, __1_0.distcp, ...   DCP data (one file per rank)
    DIR/step-000123/.metadata                         DCP metadata (every key's shape, chunks, files)
    DIR/step-000123/manifest.json                     ours, written LAST by rank 0: format, step,
                                                      every file's size and sha256, model
                                                      fingerprint, layout

The DCP state dict (keys as torchtitan writes them: model FQNs at the top level, the optimizer as
torch's `flatten_optimizer_state_dict` under "optimizer"):

    {fqn: tensor}                                      parameters and persistent buffers; a tied
                                                       parameter once, under its first name
    "optimizer": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq", ...}},
                  "param_groups": {fqn: {"lr", "betas", "weight_decay", ...}}}
    "autoplan": {"rank-00003": {"rng": {"torch": ...}, "extra": "<json>"}}   per-rank extras
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

CHECKPOINT_FORMAT = "autoplan-checkpoint/2"
MANIFEST = "manifest.json"
OPTIMIZER_KEY = "optimizer"
EXTRA_KEY = "autoplan"
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """No usable checkpoint, or one that does not fit the model (one-line message)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rank_key(rank: int) -> str:
    return f"rank-{rank:05d}"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def checkpoint_fingerprint(manifest: Mapping[str, Any]) -> str | None:
    """The model fingerprint a checkpoint's manifest records (None if it records none)."""
    return manifest.get("model_fingerprint") or (manifest.get("extra") or {}).get("model_fingerprint")
