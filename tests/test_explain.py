"""`autoplan suggest --explain` and the "nothing fits" messages (issue 29, items 2 and 6): the best
rejected configurations per reason with their figures, advice that is checked to help, and search
counts that read the same in the text and the JSON."""

from __future__ import annotations

import json
import re

import pytest

from autoplan import api
from autoplan.cli import main

SMALL = ["--model", "gpt2-small", "--cluster", "1x8xA100-80GB", "--global-batch", "12"]


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(["suggest", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_explain_lists_each_reason_and_counts_agree_with_json(capsys):
    code, text, _ = _run(capsys, *SMALL, "--explain")
    assert code == 0
    code, raw, _ = _run(capsys, *SMALL, "--explain", "--json")
    assert code == 0
    search = json.loads(raw)["search"]
    rejected = search["rejected"]
    # 12 sequences do not split over dp 8; tp 8 does not divide gpt2's 12 heads; the rest is pruned.
    assert rejected["batch"] >= 1 and rejected["layout"] >= 1 and rejected["bound"] >= 1
    by_reason = {r["reason"]: r for r in reversed(search["rejections"])}
    assert set(by_reason) >= {"batch", "layout", "bound"}
    assert any("12 attention heads" in r["why"] for r in search["rejections"] if r["reason"] == "layout")
    assert "does not split over 8 data-parallel replicas" in by_reason["batch"]["why"]
    assert "why other configurations lost" in text and "pruned by a bound" in text
    # The summary line says what the JSON says, under names that read right.
    summary = re.search(r"searched (\d+) configurations .*?: (\d+) gave a plan(?: \(the best \d+ listed\))?, (\d+) "
                        r"pruned by a bound, (\d+) over memory.*?; (\d+) memory variants", " ".join(text.split()))
    assert summary, text
    considered, planned, bound, memory, variants = map(int, summary.groups())
    assert considered == search["configs_considered"] and variants == search["configs_evaluated"]
    assert bound == rejected["bound"] and memory == rejected["memory"]
    # Counted by the search, not derived from the rejections (whose layout count includes tp degrees
    # refused before any configuration was enumerated): at least the plans listed.
    assert planned == search["configs_planned"] >= len(json.loads(raw)["plans"]) >= 1
    assert "124.44M parameters" in text  # not "0.12B"


def test_over_memory_rejections_say_how_far_and_their_fix_fits():
    model, cluster = "llama3-8b:num_layers=8", "1x8xA100-40GB"
    result, _ = api.suggest_with_stats(model, cluster, global_batch=64, seq_len=4096, explain=True)
    memory = [r for r in result.kept_rejections() if r.reason == "memory"]
    assert memory and result.rejections.counts["memory"] >= len(memory)
    for rejection in memory:
        assert rejection.need_bytes > rejection.capacity_bytes, rejection
        assert "GiB over" in rejection.why
        # As rejected, every dimension pinned: the plan the search would give does not fit ...
        pinned = api.suggest(model, cluster, global_batch=64, seq_len=4096, **rejection.pins)[0]
        assert not pinned.fits
        if rejection.fix_pins:  # ... and with the advised change it does.
            fixed = api.suggest(model, cluster, global_batch=64, seq_len=4096,
                                **{**rejection.pins, **rejection.fix_pins})[0]
            assert fixed.fits, rejection.fix
    assert any(r.fix_pins for r in memory)


def test_nothing_fits_names_the_gpus_that_would_and_not_a_smaller_batch(capsys):
    code, _, err = _run(capsys, "--model", "llama3-8b", "--cluster", "1x2xA100-40GB", "--global-batch", "64",
                        "--seq-len", "4096")
    assert code == 2 and err.count("\n") == 1 and err.startswith("autoplan: error: ")
    assert "at least 4 GPUs" in err and "reduce the batch" not in err
    cluster = re.search(r"--cluster (\S+?):", err).group(1)
    assert api.suggest("llama3-8b", cluster, global_batch=64, seq_len=4096)[0].fits


@pytest.mark.parametrize("pins", [["--tp", "1", "--pp", "1", "--zero", "0"],
                                  ["--tp", "1", "--pp", "1", "--recompute", "none", "--micro-batch-size", "4"]])
def test_pinned_nothing_fits_says_how_far_over_and_a_change_that_fits(capsys, pins):
    args = ["--model", "llama3-8b:num_layers=8", "--cluster", "1x8xA100-40GB", "--global-batch", "64",
            "--seq-len", "4096"]
    code, _, err = _run(capsys, *args, *pins)
    assert code == 2 and err.count("\n") == 1
    over = re.search(r"needs about ([\d.]+) GiB per GPU \(([\d.]+) GiB over\)", err)
    assert over and float(over.group(2)) > 0, err
    change = re.search(r"with (--[a-z-]+) (\S+): fits", err)
    assert change, err
    flag, value = change.groups()
    changed = list(pins)
    if flag in changed:
        changed[changed.index(flag) + 1] = value
    else:
        changed += [flag, value]
    code, out, err = _run(capsys, *args, *changed, "--json")
    assert code == 0, err
    assert json.loads(out)["plans"][0]["fits"]


def test_explain_with_a_sweep_is_one_line(capsys):
    code, _, err = _run(capsys, "--sweep-gpus", "8,16", "--explain")
    assert code == 2 and "--explain" in err and err.count("\n") == 1
