"""docs/cost-model.md's calibration tables equal the shipped calibration files (issue 40): every number
the tables print is the shipped one rounded to the digits printed, so a refit that does not update
the doc fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _scripts import load_benchmark

from autoplan.cost.calibration import ATTENTION_SHARE_BOUNDS, shipped_calibrations

DOC = Path(__file__).resolve().parents[1] / "docs" / "cost-model.md"
GPUS = {"A100": "A100-SXM4-80GB", "H100": "H100-SXM-80GB"}


def _table(header_start: str) -> list[list[str]]:
    """The body rows (cells stripped) of the markdown table whose header row starts with `header_start`."""
    lines = DOC.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([cell.strip() for cell in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"docs/cost-model.md has no table starting {header_start!r}")


def _agrees(printed: str, shipped: float, scale: float = 1.0) -> bool:
    """Whether `printed` (one number, any digits) is `shipped * scale` rounded to those digits."""
    match = re.fullmatch(r"\s*(-?\d+(?:\.(\d+))?)\s*(us|ms)?\s*", printed)
    assert match, f"not a number: {printed!r}"
    digits = len(match.group(2) or "")
    return abs(float(match.group(1)) - shipped * scale) <= 0.5 * 10 ** -digits + 1e-12


def _row(rows: list[list[str]], first: str) -> list[str]:
    found = [r for r in rows if r[0].startswith(first)]
    assert len(found) == 1, f"one row starting {first!r} expected in {rows}"
    return found[0]


@pytest.mark.parametrize("chip", sorted(GPUS))
def test_the_calibration_table_prints_the_shipped_numbers(chip):
    cal = shipped_calibrations()[GPUS[chip]]
    row = _row(_table("| GPU | e_gemm (bf16) |"), GPUS[chip])
    gemm, attention, causal, memory, floor = row[1:6]
    fwd, bwd = attention.split("/")
    checks = [(gemm, cal.gemm("bf16"), 1), (fwd, cal.attention_fwd_efficiency, 1),
              (bwd, cal.attention_bwd_efficiency, 1), (causal, cal.causal_work_fraction, 1),
              (memory, cal.memory_bandwidth_efficiency, 1), (floor, cal.kernel_floor_s, 1e6)]
    for printed, shipped, scale in checks:
        assert _agrees(printed, shipped, scale), f"{chip}: the doc prints {printed!r}, the file has {shipped!r}"


def test_the_attention_kernel_table_prints_the_shipped_shares_and_their_bounds():
    """Each stack's kernel, its share per chip and the kernel's published range (calibration.py
    [Note: attention kernels]), as the files and ATTENTION_SHARE_BOUNDS have them."""
    cals = shipped_calibrations()
    rows = _table("| stack | attention kernel |")
    assert rows
    seen = set()
    for row in rows:
        stack = row[0].strip("`").split()[0].strip("`")
        kernel = row[1].strip("`")
        for chip, share_cell, range_cell in (("A100", row[2], row[4]), ("H100", row[3], row[5])):
            cal = cals[GPUS[chip]]
            if stack != cal.stack and stack not in cal.stacks:
                assert share_cell == "-", f"{stack} on {chip}: the file has no such stack"
                continue
            under = cal.for_stack(stack)
            assert under.attention_kernel == kernel, f"{stack} on {chip}: {under.attention_kernel} in the file"
            if kernel == "unfused":
                assert share_cell == "-"
                continue
            assert _agrees(share_cell, under.attention_fwd_efficiency), (stack, chip, share_cell)
            assert under.attention_bwd_efficiency == under.attention_fwd_efficiency
            low, high = (float(x) for x in range_cell.split("-"))
            assert (low, high) == ATTENTION_SHARE_BOUNDS[(kernel, chip)], (stack, chip, range_cell)
            seen.add((stack, chip))
    assert {("flash", "A100"), ("flash", "H100"), ("llm-foundry", "A100"), ("llm-foundry", "H100"),
            ("megatron-core", "H100")} <= seen


def test_the_shared_fitted_numbers_in_the_doc_are_the_shipped_ones():
    cals = shipped_calibrations()
    row = _row(_table("| overlap slowdown |"), "")
    slowdown, network, unit = row[:3]
    for cal in (cals[GPUS["A100"]], cals[GPUS["H100"]]):
        assert _agrees(slowdown, cal.overlap_slowdown)
        assert _agrees(network, cal.network_efficiency)
        assert _agrees(unit, cal.fsdp_unit_overhead_s, 1e3)


def test_the_comparison_fails_on_a_number_off_by_one_in_its_last_digit():
    assert _agrees("0.692", 0.6924784) and not _agrees("0.693", 0.6924784) and not _agrees("0.639", 0.6924784)
    assert _agrees("5 us", 5e-6, 1e6) and not _agrees("6 us", 5e-6, 1e6)


def test_the_scripts_doc_writer_leaves_the_doc_as_it_is():
    """`python benchmarks/validate_published.py --write-doc-tables` (what a refit runs to update the
    doc) rewrites nothing on a doc that already prints the shipped numbers."""

    module = load_benchmark("validate_published")
    text = DOC.read_text()
    assert module._doc_tables(text) == text
    lines = text.split("\n")
    row = next(i for i, line in enumerate(lines) if line.startswith("| overlap slowdown |")) + 2
    stale = "\n".join([*lines[:row], "| 9.999 | 9.999 | 9.99 |", *lines[row + 1:]])
    assert stale != text and module._doc_tables(stale) == text
