"""The on-disk cache of profiles: where it lives, its keys, reading and writing entries.

A timed profile is keyed by the model's fingerprint, the device, shapes, dtypes, torch and the
timing method; an analytic one by everything its result depends on, the source files of the code it
runs included (`analytic_key`). Apart from the recording (graph/block_cost.py, graph/timing.py) so
that what invalidates a cached profile is read in one place.

Below the user's cache sits a read-only one shipped with the package: the analytic profiles of the
built-in models ([Note: shipped profiles]).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autoplan.graph.blocks import ModelProfile
from autoplan.graph.operators import RECORDER_VERSION
from autoplan.graph.timing import TIMING_METHOD
from autoplan.graph.trace import TracedModel

__all__ = ["SHIPPED_DIR", "analytic_key", "cached_from", "forget_cached", "profile_cache_dir", "read_cached",
           "read_shipped", "shipped_entry", "shipped_file", "shipped_key", "timed_key", "write_cached"]

_CACHED_FIELDS = f"ops-v{RECORDER_VERSION}-tp2"  # in both cache keys: profiles cached before a field existed are redone (tp2: fused_qkv)


def profile_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("AUTOPLAN_CACHE_DIR", Path.home() / ".cache" / "autoplan")) / "profiles"


def read_cached(path: Path, fingerprint: str, *, timed: bool) -> ModelProfile | None:
    if not path.exists():
        return None
    try:
        cached = ModelProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None  # a stale or damaged cache entry is re-measured and rewritten
    if cached.fingerprint != fingerprint or (timed and not cached.is_timed):
        return None
    if "tensor_parallel" not in cached.extra:  # cached before layouts were recorded
        return None
    return cached


def cached_from(profile: ModelProfile) -> Path | None:
    """The cache file a timed profile was read from (graph/profile.py marks it), or None when it was
    timed just now."""
    path = profile.extra.get("cached_from")
    return Path(path) if path else None


def forget_cached(profile: ModelProfile) -> bool:
    """Remove the cache entry `profile` was read from, so that profiling again re-times it
    (`autoplan profile --refresh`); False when it was not read from the cache."""
    path = cached_from(profile)
    if path is None:
        return False
    path.unlink(missing_ok=True)
    return True


def write_cached(path: Path, profile: ModelProfile) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one writer per file name; replace is atomic
        tmp.write_text(profile.to_json(indent=None))  # json's C encoder runs only without indent: 5x faster
        tmp.replace(path)
    except OSError:
        pass  # a read-only or full cache directory costs the next run a re-profile, nothing else


def _source_digest(paths: set[str]) -> str | None:
    h = hashlib.sha1()
    for path in sorted(paths):
        try:
            h.update(path.encode() + b"\0" + Path(path).read_bytes())
        except OSError:
            return None
    return h.hexdigest()


def _code_files(traced: TracedModel) -> set[str] | None:
    """Source files whose code decides what the traced graph computes, besides torch itself (whose
    version is in the key): every module of autoplan's graph package (the profiler, the tracer and
    what they call) and the file of every module class and called function outside torch. None when some code has no file
    (defined in a REPL or generated): then the profile is not cached, since an edit could not be seen."""
    import sys

    # The whole package, not a list of its files: a module split off the profiler later is covered too.
    files = {str(path) for path in Path(__file__).resolve().parent.glob("*.py")}
    objects: list[Any] = [type(m) for m in {type(m): m for m in traced.gm.modules()}.values()]
    objects += [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    for obj in objects:
        module_name = getattr(obj, "__module__", None) or ""
        if module_name == "torch" or module_name.startswith(("torch.", "_operator", "operator", "builtins")):
            continue
        if type(obj).__name__ == "OpOverload" or isinstance(obj, type) and issubclass(obj, fx.GraphModule):
            continue
        module = sys.modules.get(module_name)
        path = getattr(module, "__file__", None)
        if not path:
            return None
        files.add(path)
    return files


def analytic_key(traced: TracedModel, example_inputs: Sequence[Any], *, model_name: str, fingerprint: str,
                 dtype: torch.dtype | None, info: dict[str, int | None], batch_size: int | None,
                 seq_len: int | None) -> str | None:
    """Cache key of an analytic (fake-tensor) profile, or None when it cannot be cached safely.

    The result depends on the graph (its code, blocks and the parameter shapes in the model
    fingerprint), the code it calls (`_code_files`), the input shapes and dtypes, the dtype, the
    config numbers in `info`, torch (kernel choice, FLOP formulas) and autoplan."""
    from autoplan._version import __version__

    files = _code_files(traced)
    digest = _source_digest(files) if files is not None else None
    if digest is None:
        return None
    return _key("analytic", traced, example_inputs, model_name, fingerprint, dtype, info, batch_size, seq_len,
                torch.__version__, __version__, digest)


def timed_key(traced: TracedModel, *, fingerprint: str, device_name: str, batch_size: int, seq_len: int,
              dtype: torch.dtype | None, timed_dtype: torch.dtype | None) -> str:
    """Cache key of a timed profile: the model, its blocks, the device, the shapes and dtypes, torch and
    the timing method ([Note: timing in context] in graph/timing.py)."""
    return hashlib.sha1(
        json.dumps([fingerprint, traced.block_names, device_name, batch_size, seq_len, str(dtype), str(timed_dtype),
                    torch.__version__, TIMING_METHOD, _CACHED_FIELDS]).encode()
    ).hexdigest()[:20]


# [Note: shipped profiles]
# A model's first analytic profile runs it on fake tensors, and torch's first operator on fake or meta
# tensors imports torch._dynamo (sympy, parts of inductor): about 1 s of CPU, as much again as `import
# torch` (benchmarks/results/startup_floor_2core.txt). The built-in models' profiles at the shapes users
# ask for most are therefore shipped (autoplan/models/profiles/, written by benchmarks/ship_profiles.py),
# so their first `suggest` executes nothing. A shipped entry is used only when its key equals the one of
# the model just traced: `analytic_key`'s parts, with the code's files named relative to the package
# (an installed copy sits elsewhere than the checkout that wrote the files) and torch's release rather
# than its build (FLOP formulas and fake-tensor kernels do not depend on the CUDA build), and without
# autoplan's version. So an edit to the profiler or to a model's code, a preset's change, a torch upgrade
# or a RECORDER_VERSION bump makes a shipped entry unused (profiled afresh, as before), never wrong;
# tests/test_shipped_profiles.py then fails until benchmarks/ship_profiles.py is re-run, and it
# re-profiles the shipped models to check each entry equals a fresh profile. The profile's
# `torch_version` is set to the running torch's, as a fresh run records it. `AUTOPLAN_SHIPPED_PROFILES=0`
# turns the shipped entries off (benchmarks/search_speed.py measures a first run without them).

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DIR = _PACKAGE_ROOT / "models" / "profiles"
SHIPPED_FORMAT = 1
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _torch_release() -> str:
    return torch.__version__.split("+", 1)[0]


def _package_digest(paths: set[str]) -> str | None:
    """`_source_digest` with each file named relative to the autoplan package; None when some file lies
    outside it (a user's model: no entry is shipped for it)."""
    named = {}
    for path in paths:
        try:
            named[Path(path).resolve().relative_to(_PACKAGE_ROOT).as_posix()] = path
        except ValueError:
            return None
    h = hashlib.sha1()
    for name in sorted(named):
        try:
            h.update(name.encode() + b"\0" + Path(named[name]).read_bytes())
        except OSError:
            return None
    return h.hexdigest()


def shipped_key(traced: TracedModel, example_inputs: Sequence[Any], *, model_name: str, fingerprint: str,
                dtype: torch.dtype | None, info: dict[str, int | None], batch_size: int | None,
                seq_len: int | None) -> str | None:
    """Key of a shipped analytic profile ([Note: shipped profiles]), or None when the model's code is
    not all autoplan's."""
    files = _code_files(traced)
    digest = _package_digest(files) if files is not None else None
    if digest is None:
        return None
    return _key("shipped", traced, example_inputs, model_name, fingerprint, dtype, info, batch_size, seq_len,
                _torch_release(), digest)


def _key(kind: str, traced: TracedModel, example_inputs: Sequence[Any], model_name: str, fingerprint: str,
         dtype: torch.dtype | None, info: dict[str, int | None], batch_size: int | None, seq_len: int | None,
         *versions: str) -> str:
    """The key of a profile of `kind`: the graph, its inputs, the job's sizes and `versions` (torch's,
    autoplan's, the digest of the code it runs), hashed."""
    inputs = [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    parts = [kind, fingerprint, model_name, traced.tracer, traced.note, traced.block_names, traced.gm.code,
             inputs, str(dtype), sorted((k, v) for k, v in info.items()), batch_size, seq_len, *versions,
             _CACHED_FIELDS]
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def shipped_file(model_name: str, dtype: torch.dtype | None, batch_size: int | None, seq_len: int | None) -> Path | None:
    """Where a shipped profile of `model_name` at these shapes would be, or None for a name that is
    no built-in model's (a file path, a spec with overrides)."""
    if not _PLAIN_NAME.fullmatch(model_name) or batch_size is None or seq_len is None:
        return None
    return SHIPPED_DIR / f"{model_name}-{str(dtype).removeprefix('torch.')}-b{batch_size}-s{seq_len}.json.gz"


def shipped_entry(key: str, profile: ModelProfile) -> bytes:
    """A shipped file's bytes (benchmarks/ship_profiles.py): the key, and the profile as a fresh run
    made it, its keys in the order it holds them. gzip without a timestamp, so that equal profiles give
    equal files."""
    entry = {"format": SHIPPED_FORMAT, "key": key, "recorder": _CACHED_FIELDS, "torch": _torch_release(),
             "profile": profile.to_dict()}
    return gzip.compress(json.dumps(entry, separators=(",", ":")).encode(), 9, mtime=0)


def read_shipped(traced: TracedModel, example_inputs: Sequence[Any], *, model_name: str, fingerprint: str,
                 dtype: torch.dtype | None, info: dict[str, int | None], batch_size: int | None,
                 seq_len: int | None) -> ModelProfile | None:
    """The shipped analytic profile of this model at these shapes, or None when there is none, it was
    made for another graph, config, code, torch or recorder, or shipped entries are turned off."""
    if os.environ.get("AUTOPLAN_SHIPPED_PROFILES", "1") == "0":
        return None
    path = shipped_file(model_name, dtype, batch_size, seq_len)
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(gzip.decompress(path.read_bytes()))
        if entry.get("format") != SHIPPED_FORMAT:
            return None
        key = shipped_key(traced, example_inputs, model_name=model_name, fingerprint=fingerprint, dtype=dtype,
                          info=info, batch_size=batch_size, seq_len=seq_len)
        if key is None or entry.get("key") != key:
            return None
        profile = ModelProfile.from_dict(entry["profile"])
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError, AttributeError):
        return None  # damaged package data costs a fake-tensor run, nothing else
    if profile.fingerprint != fingerprint:
        return None
    # The running torch, as a fresh profile records it (the key matched its release).
    return dataclasses.replace(profile, torch_version=torch.__version__)
