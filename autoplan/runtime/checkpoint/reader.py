"""An opened checkpoint (`Checkpoint`: its manifest and DCP metadata, tensors read on first use)
and the DCP read into this process that it, integrity.py and restore.py share (`dcp_load`).

Apart from load.py, which finds and verifies a checkpoint before it opens it here: integrity.py's
last check reads each rank's record of the step through a `Checkpoint`.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoplan.runtime.checkpoint.format import EXTRA_KEY, OPTIMIZER_KEY, CheckpointError, one_line
from autoplan.runtime.checkpoint.planners import Pieces, Placeholder, load_planner, with_pieces


def dcp_load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (tensors in place, other values replaced) from the checkpoint at `path`, in this
    process alone: a rank reads the chunks its tensors cover, no collective (so `restore` and the
    full loads run on any subset of ranks, or without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tree = with_pieces(state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
            dcp.load(tree, storage_reader=dcp.FileSystemReader(path), planner=load_planner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # a corrupt file in a directory whose manifest says complete
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {one_line(root_cause(exc))}") from exc
    _merge_back(state, tree)


def root_cause(exc: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (a BaseException holding each rank's failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))  # (exception, traceback) per failed rank
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            return first
    return exc


def _merge_back(state: dict[str, Any], tree: Mapping[str, Any]) -> None:
    """Values DCP replaced in `tree` (non-tensors) into `state`; tensors were loaded in place."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and isinstance(state.get(key), dict):
            _merge_back(state[key], value)
        elif not isinstance(value, Pieces | Placeholder):  # those were loaded in place
            state[key] = value


@dataclass
class Checkpoint:
    """One complete checkpoint: its manifest and DCP metadata; tensors are read when asked for."""

    path: Path
    step: int
    manifest: dict[str, Any]
    metadata: Any
    """DCP's `Metadata`: every key's shape, dtype and chunks."""

    def __post_init__(self) -> None:
        self.aliases: dict[str, str] = dict(self.manifest.get("aliases") or {})
        """Every name of a tied parameter -> the name it is saved under."""
        self.model_keys: dict[str, Any] = {}
        """Saved parameter / buffer name -> its DCP storage metadata."""
        self.optimizer_keys: dict[str, dict[str, str]] = {}
        """Parameter name -> {state entry -> DCP key}."""
        self.hyperparameter_keys: dict[str, dict[str, str]] = {}
        """Parameter name -> {hyperparameter -> DCP key}."""
        self.rank_keys: dict[int, dict[tuple[str, ...], str]] = {}
        """Rank -> {path under "autoplan.rank-R" -> DCP key}."""
        paths = getattr(self.metadata, "planner_data", None) or {}
        for key, md in self.metadata.state_dict_metadata.items():
            path = tuple(paths.get(key, (key,)))
            if len(path) == 4 and path[0] == OPTIMIZER_KEY and path[1] == "state":
                self.optimizer_keys.setdefault(path[2], {})[path[3]] = key
            elif len(path) == 4 and path[0] == OPTIMIZER_KEY and path[1] == "param_groups":
                self.hyperparameter_keys.setdefault(path[2], {})[path[3]] = key
            elif len(path) >= 3 and path[0] == EXTRA_KEY and path[1].startswith("rank-"):
                self.rank_keys.setdefault(int(path[1][5:]), {})[path[2:]] = key
            elif len(path) == 1:
                self.model_keys[key] = md

    def saved_name(self, name: str, table: Mapping[str, Any]) -> str | None:
        """The key `name` (any name of a tied parameter) is saved under in `table`, or None."""
        if name in table:
            return name
        canonical = self.aliases.get(name)
        if canonical is not None and canonical in table:
            return canonical
        return next((other for other, c in self.aliases.items() if c == name and other in table), None)

    def lookup(self, name: str, table: Mapping[str, Any] | None = None) -> Any:
        table = self.params if table is None else table
        key = self.saved_name(name, table)
        return None if key is None else table[key]

    def _load_flat(self, keys: Mapping[str, str]) -> dict[str, Any]:
        """{label: value} of the DCP keys {label: key}, whole, in this process."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        state: dict[str, Any] = {}
        for key in keys.values():
            md = self.metadata.state_dict_metadata[key]
            state[key] = (torch.empty(md.size, dtype=md.properties.dtype)
                          if isinstance(md, TensorStorageMetadata) else None)
        # Keys are flat strings here: DCP's flattening maps each back to itself.
        dcp_load(self.path, state)
        return {label: state[key] for label, key in keys.items()}

    @functools.cached_property
    def params(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers, whole, under every name the model uses (tied aliases
        filled in)."""
        params = self._load_flat({k: k for k in self.model_keys})
        for name, canonical in self.aliases.items():  # a plain model's state_dict names every tied alias
            if name not in params and canonical in params:
                params[name] = params[canonical]
        return params

    @functools.cached_property
    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Per-parameter optimizer state (AdamW: step, exp_avg, exp_avg_sq), whole, by name."""
        out = self._load_by_name(self.optimizer_keys)
        for name, canonical in self.aliases.items():
            if name not in out and canonical in out:
                out[name] = out[canonical]
        return out

    @functools.cached_property
    def hyperparameters(self) -> dict[str, dict[str, Any]]:
        """Each parameter's optimizer group hyperparameters (lr, betas, ...), by name."""
        return self._load_by_name(self.hyperparameter_keys)

    def _load_by_name(self, keys: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, Any]]:
        """{parameter name: {entry: value}} for `keys` ({parameter name: {entry: DCP key}})."""
        flat = self._load_flat({(n, k): key for n, entries in keys.items() for k, key in entries.items()})
        out: dict[str, dict[str, Any]] = {}
        for (name, k), value in flat.items():
            out.setdefault(name, {})[k] = value
        return out

    @functools.cached_property
    def rank_state(self) -> dict[int, dict[str, Any]]:
        """Rank -> what it saved of its own: {"rng": {"torch": ByteTensor, ...}, "extra": {...}}."""
        flat = self._load_flat({(r, path): key for r, entries in self.rank_keys.items()
                                for path, key in entries.items()})
        out: dict[int, dict[str, Any]] = {}
        for (r, path), value in flat.items():
            node = out.setdefault(r, {})
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = json.loads(value) if path == ("extra",) else value
        return out

    @property
    def rng(self) -> dict[int, Any]:
        """Rank -> its saved RNG states."""
        return {r: s.get("rng") for r, s in self.rank_state.items()}
