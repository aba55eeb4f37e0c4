"""The built-in models' shipped analytic profiles ([Note: shipped profiles] in graph/profile_cache.py):
each file equal to what a fresh profile writes (a stale file fails here), one file per shipped case,
and a shipped entry used only for the model, shapes and recorder it was made for."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from _scripts import load_benchmark

from autoplan.api import profile_with_graph
from autoplan.graph import profile_cache
from autoplan.graph.blocks import ModelProfile

ROOT = Path(__file__).resolve().parent.parent


SHIP = load_benchmark("ship_profiles")
CASES = SHIP.cases()
# By default the families' largest models (gpt, llama, moe: the profiler's code paths); the rest in
# the extended tier (each re-profile is a few seconds).
DEFAULT = {("gpt3-175b", 2048), ("llama3-8b", 8192), ("mixtral-8x7b", 4096)}


def _param(case: tuple[str, int]):
    marks = () if case in DEFAULT else (pytest.mark.extended,)
    return pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=marks)


@pytest.mark.parametrize(("name", "seq_len"), [_param(c) for c in CASES])
def test_shipped_file_equals_a_fresh_profile(name, seq_len):
    path, fresh = SHIP.fresh_entry(name, seq_len)
    assert path.is_file(), f"{path.name} is not shipped: run python benchmarks/ship_profiles.py {name}"
    assert path.read_bytes() == fresh, f"{path.name} is stale: run python benchmarks/ship_profiles.py {name}"


@pytest.mark.parametrize(("name", "seq_len"), [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in CASES])
def test_every_shipped_file_has_the_key_of_its_model_today(name, seq_len):
    """Cheap (the model is traced, not profiled), so every case runs by default: a preset, its graph,
    torch's release or RECORDER_VERSION changed since the file was written fails here."""
    path, key = SHIP.current_key(name, seq_len)
    assert path.is_file(), f"{path.name} is not shipped: run python benchmarks/ship_profiles.py {name}"
    entry = json.loads(gzip.decompress(path.read_bytes()))
    assert entry["key"] == key, f"{path.name} is stale: run python benchmarks/ship_profiles.py {name}"


def test_every_shipped_file_is_a_shipped_case():
    assert set(CASES) >= DEFAULT
    expected = {profile_cache.shipped_file(name, torch.bfloat16, 1, seq).name for name, seq in CASES}
    shipped = {p.name for p in profile_cache.SHIPPED_DIR.glob("*.json.gz")}
    assert shipped == expected, f"missing {sorted(expected - shipped)}, not a case {sorted(shipped - expected)}"
    for path in profile_cache.SHIPPED_DIR.glob("*.json.gz"):
        entry = json.loads(gzip.decompress(path.read_bytes()))
        assert entry["format"] == profile_cache.SHIPPED_FORMAT
        assert ModelProfile.from_dict(entry["profile"]).model_name == path.name.split("-bfloat16")[0]
        assert path.stat().st_size < 64 * 1024  # package data stays small


# A small preset at a short length keeps the fake runs below fast; shipped into a temporary directory.
SMALL, SMALL_SEQ = "gpt2-small", 64


@pytest.fixture
def shipped_small(tmp_path, monkeypatch):
    monkeypatch.setattr(profile_cache, "SHIPPED_DIR", tmp_path / "shipped")
    path, data = SHIP.fresh_entry(SMALL, SMALL_SEQ)
    assert path.parent == tmp_path / "shipped"
    path.parent.mkdir()
    path.write_bytes(data)
    return path


def _profile(cache_dir):
    return profile_with_graph(SMALL, batch_size=1, seq_len=SMALL_SEQ, dtype="bf16", cache_dir=cache_dir).profile


def test_a_shipped_profile_is_used_and_equals_a_fresh_one(shipped_small, tmp_path, monkeypatch):
    used = _profile(tmp_path / "cache-a")
    assert not (tmp_path / "cache-a").exists()  # nothing ran, so nothing was cached
    monkeypatch.setenv("AUTOPLAN_SHIPPED_PROFILES", "0")
    fresh = _profile(tmp_path / "cache-b")
    assert list((tmp_path / "cache-b").glob("analytic-*.json"))  # this one was profiled
    assert used.to_json() == fresh.to_json()


@pytest.mark.parametrize("damage", ["key", "recorder", "code", "fingerprint", "gzip", "format"])
def test_a_shipped_entry_that_does_not_match_is_ignored(shipped_small, tmp_path, monkeypatch, damage):
    if damage == "recorder":  # what is recorded changed since the file was made (RECORDER_VERSION)
        monkeypatch.setattr(profile_cache, "_CACHED_FIELDS", profile_cache._CACHED_FIELDS + "-next")
    elif damage == "code":  # the profiler's or the model's files were edited since
        digest = profile_cache._package_digest
        monkeypatch.setattr(profile_cache, "_package_digest", lambda paths: digest(paths) + "-edited")
    elif damage == "gzip":
        shipped_small.write_bytes(shipped_small.read_bytes()[:100])
    else:
        entry = json.loads(gzip.decompress(shipped_small.read_bytes()))
        if damage == "key":  # made for another graph, config, torch or recorder
            entry["key"] = "0" * 20
        elif damage == "format":
            entry["format"] = profile_cache.SHIPPED_FORMAT + 1
        else:
            entry["profile"]["fingerprint"] = "0" * 16
        shipped_small.write_bytes(gzip.compress(json.dumps(entry).encode()))
    _profile(tmp_path / "cache")
    assert list((tmp_path / "cache").glob("analytic-*.json")), "the damaged entry was used instead of profiling"


def test_only_plain_names_have_a_shipped_file():
    assert profile_cache.shipped_file("gpt3-175b", torch.bfloat16, 1, 2048).name == "gpt3-175b-bfloat16-b1-s2048.json.gz"
    for name in ("gpt3-175b:num_layers=2", "examples/custom_model.py:build", "../x", ""):
        assert profile_cache.shipped_file(name, torch.bfloat16, 1, 2048) is None
    assert profile_cache.shipped_file("gpt3-175b", torch.bfloat16, None, 2048) is None


def test_code_outside_the_package_has_no_shipped_key(tmp_path):
    inside = profile_cache.__file__
    assert profile_cache._package_digest({inside}) is not None
    (tmp_path / "model.py").write_text("x = 1\n")
    assert profile_cache._package_digest({inside, str(tmp_path / "model.py")}) is None
