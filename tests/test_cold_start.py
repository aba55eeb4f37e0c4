"""A built-in model's first `autoplan suggest` (an empty profile cache) executes nothing on fake
tensors, so it does not pay torch._dynamo's import ([Note: shipped profiles] in
graph/profile_cache.py), and prints and writes exactly what a freshly profiled run does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import scaled_timeout_s


def _suggest(tmp_path, tag: str, args: list[str], *, shipped: bool, importtime: bool = False):
    where = tmp_path / tag  # each run in its own directory, writing the same relative --out path
    where.mkdir()
    cache = where / "cache"
    env = dict(os.environ, AUTOPLAN_CACHE_DIR=str(cache), AUTOPLAN_SHIPPED_PROFILES="1" if shipped else "0")
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "autoplan", "suggest", *args,
            "--out", "plan.json"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=where, timeout=scaled_timeout_s(240))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, cache, json.loads((where / "plan.json").read_text())


def _without_times(text: str) -> str:
    """The search's own wall time is the one figure two identical runs differ in."""
    return re.sub(r"configurations \(([^)]*)\) in [0-9.]+ s", r"configurations (\1) in T s", text)


def _plan_without_times(plan: dict) -> str:
    return _without_times(json.dumps(plan, sort_keys=True))


SMALL_CASE = ["--model", "gpt3-175b", "--cluster", "8x8xA100-80GB", "--global-batch", "64", "--seq-len", "2048"]
RATIO_CASE = ["--model", "gpt3-175b", "--cluster", "128x8xA100-80GB", "--global-batch", "1536", "--seq-len", "2048"]


@pytest.mark.parametrize("args", [pytest.param(SMALL_CASE, id="gpt3-175b-64xA100"),
                                  pytest.param(RATIO_CASE, id="gpt3-175b-1024xA100", marks=pytest.mark.extended)])
def test_a_cold_suggest_of_a_builtin_model_runs_nothing_and_prints_what_a_fresh_profile_gives(tmp_path, args):
    shipped, shipped_cache, shipped_plan = _suggest(tmp_path, "shipped", args, shipped=True, importtime=True)
    fresh, fresh_cache, fresh_plan = _suggest(tmp_path, "fresh", args, shipped=False)
    # The shipped profile was read: nothing was profiled (so nothing cached) and torch._dynamo, which the
    # first fake-tensor operator imports, never was.
    assert not list(shipped_cache.glob("profiles/analytic-*.json"))
    assert list(fresh_cache.glob("profiles/analytic-*.json"))
    imported = {line.split("|")[-1].strip() for line in shipped.stderr.splitlines() if line.startswith("import time:")}
    assert "torch.fx" in imported  # -X importtime did report
    assert "torch._dynamo" not in imported
    assert _without_times(shipped.stdout) == _without_times(fresh.stdout)
    assert _plan_without_times(shipped_plan) == _plan_without_times(fresh_plan)


def test_a_spec_with_overrides_is_profiled_as_before(tmp_path):
    """No shipped entry names a model with overrides: it is profiled on fake tensors and cached."""
    args = ["--model", "gpt3-1.3b:num_layers=2", "--cluster", "1x8xA100-80GB", "--global-batch", "16",
            "--seq-len", "512"]
    _, cache, plan = _suggest(tmp_path, "override", args, shipped=True)
    assert list(cache.glob("profiles/analytic-*.json"))
    assert plan["model"].startswith("gpt3-1.3b")
