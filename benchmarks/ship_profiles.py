"""Write the built-in models' shipped analytic profiles (autoplan/models/profiles/*.json.gz).

    python benchmarks/ship_profiles.py            # re-profile every shipped case and rewrite the files
    python benchmarks/ship_profiles.py --check    # exit 1 and name each file a fresh profile differs from

A model's first `suggest` otherwise runs it on fake tensors, whose first operator imports
torch._dynamo ([Note: shipped profiles] in autoplan/graph/profile_cache.py). Each file holds the
profile exactly as a fresh run makes it, with the key the runtime computes for that model, so a
shipped entry is used only for the graph, config, shapes, code (the profiler's and the model's files),
torch release and recorder it was made for; otherwise the model is profiled afresh, as without it.
tests/test_shipped_profiles.py checks every key and re-runs `fresh_entry`, and fails when a file
differs: after a change to autoplan/graph/ or to a built-in model, run this script and commit the files.

Cases: every built-in preset at its default sequence length, plus the lengths the README's
commands use; batch 1 and bf16, which is what `autoplan suggest` profiles by default.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXTRA_SEQ_LENS = {"llama3-8b": (4096,), "mixtral-8x7b": (4096,), "mixtral-8x22b": (4096,)}
"""Lengths besides each preset's default: those of the README's `suggest` commands."""


def cases() -> list[tuple[str, int]]:
    """(preset, sequence length) of every shipped profile."""
    from autoplan.models.presets import PRESETS

    out = []
    for name, config in PRESETS.items():
        out.append((name, config.max_seq_len))
        out += [(name, s) for s in EXTRA_SEQ_LENS.get(name, ()) if s != config.max_seq_len]
    return out


class _KeyOnly(Exception):
    """Stops `profile_with_graph` once the arguments of the profile are known."""


@contextlib.contextmanager
def _fresh_profiles(*, profile: bool = True) -> Iterator[list[tuple[dict[str, Any], Any]]]:
    """Profile without the shipped or the user's cache, and keep each `profile_traced` call's
    arguments and result: the key is computed from exactly what the runtime passes. Without
    `profile`, the call is stopped before profiling (`_KeyOnly`) and its result is None."""
    import autoplan.graph.profile as profile_module

    calls: list[tuple[dict[str, Any], Any]] = []
    original = profile_module.profile_traced

    def recording(traced, example_inputs, **kwargs):
        result = original(traced, example_inputs, **kwargs) if profile else None
        calls.append(({"traced": traced, "example_inputs": example_inputs, **kwargs}, result))
        if not profile:
            raise _KeyOnly
        return result

    saved = os.environ.get("AUTOPLAN_SHIPPED_PROFILES")
    os.environ["AUTOPLAN_SHIPPED_PROFILES"] = "0"
    profile_module.profile_traced = recording
    try:
        yield calls
    finally:
        profile_module.profile_traced = original
        if saved is None:
            os.environ.pop("AUTOPLAN_SHIPPED_PROFILES", None)
        else:
            os.environ["AUTOPLAN_SHIPPED_PROFILES"] = saved


def _profiled(name: str, seq_len: int, *, profile: bool) -> tuple[Path, str, Any]:
    from autoplan.api import profile_with_graph
    from autoplan.graph.profile_cache import shipped_file, shipped_key

    with tempfile.TemporaryDirectory(prefix="autoplan-ship-") as cache_dir, \
            _fresh_profiles(profile=profile) as calls, contextlib.suppress(_KeyOnly):
        profile_with_graph(name, batch_size=1, seq_len=seq_len, dtype="bf16", cache_dir=cache_dir)
    (kwargs, result), = calls
    args = {k: kwargs[k] for k in ("traced", "example_inputs", "model_name", "fingerprint", "dtype", "info",
                                   "batch_size", "seq_len")}
    path = shipped_file(args["model_name"], args["dtype"], args["batch_size"], args["seq_len"])
    key = shipped_key(**args)
    assert path is not None and key is not None, f"{name}: no shipped profile can be keyed for it"
    return path, key, result


def fresh_entry(name: str, seq_len: int) -> tuple[Path, bytes]:
    """The shipped file of `name` at `seq_len` and the bytes a fresh profile gives it."""
    from autoplan.graph.profile_cache import shipped_entry

    path, key, profile = _profiled(name, seq_len, profile=True)
    return path, shipped_entry(key, profile)


def current_key(name: str, seq_len: int) -> tuple[Path, str]:
    """The shipped file of `name` at `seq_len` and the key the runtime looks it up by (the model is
    built and traced, not profiled: a fraction of a second)."""
    path, key, _ = _profiled(name, seq_len, profile=False)
    return path, key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files, write nothing")
    parser.add_argument("names", nargs="*", help="only these presets (default: all)")
    args = parser.parse_args()
    stale = 0
    wanted = [(n, s) for n, s in cases() if not args.names or n in args.names]
    written: set[Path] = set()
    for name, seq_len in wanted:
        path, data = fresh_entry(name, seq_len)
        written.add(path)
        same = path.is_file() and path.read_bytes() == data
        if args.check:
            if not same:
                stale += 1
                print(f"stale: {path.name} (run python benchmarks/ship_profiles.py {name})")
            continue
        if not same:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        print(f"{'kept' if same else 'wrote'} {path.name} ({len(data) / 1024:.1f} KiB)")
    if not args.names and not args.check:  # files of cases no longer shipped
        for old in sorted(written and next(iter(written)).parent.glob("*.json.gz")):
            if old not in written:
                old.unlink()
                print(f"removed {old.name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
