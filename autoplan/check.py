"""`autoplan check`: a plan-quality regression gate for CI.

A suite (YAML) lists models, clusters and jobs; each case is planned with `suggest_with_stats`
(top 1) and its best plan compared with a committed baseline (JSON) of the same case name. A case
fails when predicted tokens/s drops by more than `tolerance.throughput` (relative), peak memory
per GPU grows by more than `tolerance.memory` (relative), the plan no longer fits or no plan is
found, or the search takes longer than `tolerance.search_time_s` (absolute seconds). A case not in
the baseline is "new": reported, not failed, unless `strict`.

The baseline is checked for drift in both directions: a case whose tokens/s rose or whose memory fell
by more than the tolerance is "improved", and fails too, with a line saying to refresh the baseline
with `--update`. A baseline that lags the planner by 10% hides the next 10% regression (issue 44:
`ci/plan_quality_baseline.json` was 9.7% tokens/s and 14.7% memory away from the predictions while
every case passed). `--update` prints each case's old -> new figures before it rewrites the file.

Every mistake in the suite or baseline file is a one-line `SuiteError` (a ValueError, so the CLI
prints `autoplan: error: ...` and exits 2) naming the case and the field.
"""

from __future__ import annotations

import json
import math
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autoplan._files import parse_yaml, read_json, read_text

__all__ = [
    "BASELINE_SCHEMA_VERSION",
    "Case",
    "CaseResult",
    "CheckReport",
    "Suite",
    "SuiteError",
    "Tolerance",
    "compare",
    "load_baseline",
    "load_previous_baseline",
    "load_suite",
    "plan_metrics",
    "report_table",
    "run_case",
    "run_check",
    "run_command",
    "write_baseline",
    "write_json",
    "write_junit",
]

BASELINE_SCHEMA_VERSION = 1

# Pin names and the types a YAML value may have (keys as `autoplan.suggest` takes them).
_PIN_TYPES: dict[str, tuple[type, ...]] = {
    "tp": (int,), "pp": (int,), "dp": (int,), "micro_batch_size": (int,), "virtual_stages": (int,), "zero": (int,),
    "dp_replicate": (int,), "ep": (int,), "cp": (int,),
    "schedule": (str,), "recompute": (str,), "rank_order": (str,), "sequence_parallel": (bool,),
    "reduce_dtype": (str,), "expert_tp": (int,),
}
_CASE_KEYS = {"name", "model", "cluster", "global_batch", "seq_len", "dtype", "pins"}


class SuiteError(ValueError):
    """A suite or baseline file that cannot be used; one line naming the case and field."""


@dataclass(frozen=True)
class Tolerance:
    throughput: float = 0.02
    """Largest allowed relative drop of predicted tokens/s (0.02 = 2%)."""
    memory: float = 0.02
    """Largest allowed relative growth of peak memory per GPU."""
    search_time_s: float = 30.0
    """Time budget of one case's search, in seconds."""


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    cluster: str
    global_batch: int
    seq_len: int | None = None
    dtype: str = "bf16"
    pins: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Suite:
    cases: tuple[Case, ...]
    tolerance: Tolerance = Tolerance()
    path: str = ""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _type_name(v: object) -> str:
    return type(v).__name__


def load_suite(path: str | os.PathLike) -> Suite:
    """Read and validate a suite YAML; see the module docstring for the format."""
    path = Path(path)
    text = read_text(path, "suite file", SuiteError, "write one as docs/ci.md describes")
    data = parse_yaml(text, f"suite {str(path)!r}", SuiteError)
    return parse_suite(data, where=str(path))


def parse_suite(data: Any, where: str = "suite") -> Suite:
    if not isinstance(data, Mapping):
        raise SuiteError(f"{where}: expected a mapping with a 'cases' list, got {_type_name(data)}")
    unknown = set(data) - {"tolerance", "cases"}
    if unknown:
        raise SuiteError(f"{where}: unknown top-level key {sorted(map(str, unknown))[0]!r}; use 'tolerance' and 'cases'")
    tolerance = Tolerance()
    raw_tol = data.get("tolerance")
    if raw_tol is not None:
        if not isinstance(raw_tol, Mapping):
            raise SuiteError(f"{where}: 'tolerance' must be a mapping, got {_type_name(raw_tol)}")
        allowed = {"throughput", "memory", "search_time_s"}
        for key, value in raw_tol.items():
            if key not in allowed:
                raise SuiteError(f"{where}: unknown tolerance {key!r}; use {', '.join(sorted(allowed))}")
            if not _is_number(value) or value < 0:
                raise SuiteError(f"{where}: tolerance.{key} must be a non-negative number, got {value!r}")
        tolerance = Tolerance(**{k: float(v) for k, v in raw_tol.items()})
    raw_cases = data.get("cases")
    if not isinstance(raw_cases, list) or not raw_cases:
        raise SuiteError(f"{where}: 'cases' must be a non-empty list")
    cases = []
    names: set[str] = set()
    for i, raw in enumerate(raw_cases):
        case = _parse_case(raw, i, where)
        if case.name in names:
            raise SuiteError(f"{where}: case {case.name!r} appears twice; case names must be unique")
        names.add(case.name)
        cases.append(case)
    return Suite(tuple(cases), tolerance, where)


def _parse_case(raw: Any, index: int, where: str) -> Case:
    label = f"case #{index + 1}"
    if not isinstance(raw, Mapping):
        raise SuiteError(f"{where}: {label} must be a mapping, got {_type_name(raw)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise SuiteError(f"{where}: {label}: field 'name' is missing or not a string")
    label = f"case {name!r}"
    unknown = set(raw) - _CASE_KEYS
    if unknown:
        raise SuiteError(f"{where}: {label}: unknown field {sorted(map(str, unknown))[0]!r}; "
                         f"fields are {', '.join(sorted(_CASE_KEYS))}")
    for key in ("model", "cluster"):
        if key not in raw:
            raise SuiteError(f"{where}: {label}: missing field {key!r}")
        if not isinstance(raw[key], str) or not raw[key]:
            raise SuiteError(f"{where}: {label}: field {key!r} must be a string, got {raw[key]!r}")
    if "global_batch" not in raw:
        raise SuiteError(f"{where}: {label}: missing field 'global_batch'")
    for key in ("global_batch", "seq_len"):
        value = raw.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise SuiteError(f"{where}: {label}: field {key!r} must be a positive integer, got {value!r}")
    dtype = raw.get("dtype", "bf16")
    if not isinstance(dtype, str):
        raise SuiteError(f"{where}: {label}: field 'dtype' must be a string, got {dtype!r}")
    pins = raw.get("pins") or {}
    if not isinstance(pins, Mapping):
        raise SuiteError(f"{where}: {label}: field 'pins' must be a mapping, got {_type_name(pins)}")
    for key, value in pins.items():
        if key not in _PIN_TYPES:
            raise SuiteError(f"{where}: {label}: unknown pin {key!r} in field 'pins'; pins are {', '.join(_PIN_TYPES)}")
        types = _PIN_TYPES[key]
        if not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            raise SuiteError(f"{where}: {label}: pins.{key} must be {'/'.join(t.__name__ for t in types)}, "
                             f"got {value!r}")
    return Case(name=name, model=raw["model"], cluster=raw["cluster"], global_batch=raw["global_batch"],
                seq_len=raw.get("seq_len"), dtype=dtype, pins=dict(pins))


def validate_case_specs(suite: Suite) -> None:
    """Parse every model and cluster spec before running anything, so a typo fails in a second."""
    from autoplan import models as zoo
    from autoplan.cluster import parse_cluster

    for case in suite.cases:
        for key, parse in (("model", zoo.parse_model_spec), ("cluster", parse_cluster)):
            try:
                parse(getattr(case, key))
            except (ValueError, FileNotFoundError) as exc:
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise SuiteError(f"{suite.path}: case {case.name!r}: field {key!r}: {msg}") from None


# ---- baseline -------------------------------------------------------------------------------

_METRIC_KEYS = ("tokens_per_s", "peak_memory_bytes", "fits")


def load_baseline(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Case name -> metrics of a baseline file written by `write_baseline`."""
    data = read_json(path, "baseline", SuiteError, f"create it with `autoplan check SUITE --baseline {path} --update`")
    if not isinstance(data, Mapping) or not isinstance(data.get("cases"), Mapping):
        raise SuiteError(f"baseline {str(path)!r} must be an object with a 'cases' object")
    if data.get("schema_version") != BASELINE_SCHEMA_VERSION:
        raise SuiteError(f"baseline {str(path)!r} has schema_version {data.get('schema_version')!r}; this autoplan "
                         f"reads {BASELINE_SCHEMA_VERSION}: regenerate it with --update")
    cases: dict[str, dict[str, Any]] = {}
    for name, entry in data["cases"].items():
        if not isinstance(entry, Mapping):
            raise SuiteError(f"baseline {str(path)!r}: case {name!r} must be an object")
        for key in _METRIC_KEYS:
            if key not in entry:
                raise SuiteError(f"baseline {str(path)!r}: case {name!r}: missing field {key!r}")
        for key in ("tokens_per_s", "peak_memory_bytes"):
            if not _is_number(entry[key]) or entry[key] < 0:
                raise SuiteError(f"baseline {str(path)!r}: case {name!r}: field {key!r} must be a non-negative "
                                 f"number, got {entry[key]!r}")
        if not isinstance(entry["fits"], bool):
            raise SuiteError(f"baseline {str(path)!r}: case {name!r}: field 'fits' must be true or false")
        cases[str(name)] = dict(entry)
    return cases


def load_previous_baseline(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The baseline `--update` is about to replace, for its old -> new lines: {} when the file is
    missing or unreadable (an update is how a damaged or outdated baseline is repaired)."""
    if not Path(path).exists():
        return {}
    try:
        return load_baseline(path)
    except SuiteError:
        return {}


def write_baseline(path: str | os.PathLike, results: Sequence[CaseResult]) -> int:
    """Write the current metrics of every case that has a plan, atomically; returns how many."""
    from autoplan._version import __version__

    cases = {r.case.name: r.current for r in results if r.current is not None}
    data = {"schema_version": BASELINE_SCHEMA_VERSION, "autoplan_version": __version__, "cases": cases}
    _atomic_write(Path(path), json.dumps(data, indent=2, sort_keys=False) + "\n")
    return len(cases)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# ---- running and comparing ------------------------------------------------------------------

def plan_metrics(plan, search_time_s: float) -> dict[str, Any]:
    """What a baseline records of a best plan."""
    p = plan.predicted
    return {
        "tokens_per_s": float(p.tokens_per_s),
        "peak_memory_bytes": float(p.peak_memory_bytes),
        "fits": bool(plan.fits),
        "step_time_s": float(p.step_time_s),
        "mfu": float(p.mfu),
        "config": (f"tp{plan.tp} pp{plan.pp} dp{plan.dp} mbs{plan.micro_batch_size} {plan.schedule}"
                   + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
                   + f" recompute={plan.recompute} zero{plan.zero}" + (" sp" if plan.sequence_parallel else "")),
        "search_time_s": round(float(search_time_s), 3),
    }


def run_case(case: Case) -> tuple[dict[str, Any] | None, str | None, float]:
    """Plan one case: (metrics of the best plan or None, error message or None, search seconds)."""
    from autoplan.api import suggest_with_stats

    started = time.perf_counter()
    try:
        result, _ = suggest_with_stats(case.model, case.cluster, global_batch=case.global_batch, seq_len=case.seq_len,
                                       dtype=case.dtype, top=1, **case.pins)
    except ValueError as exc:  # PlanningError and friends: no plan for this case
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, msg, time.perf_counter() - started
    if not result.plans:
        return None, "the search returned no plan", time.perf_counter() - started
    return plan_metrics(result.plans[0], result.time_s), None, result.time_s


@dataclass
class CaseResult:
    case: Case
    status: str
    """pass, fail, improved (past the tolerance: the baseline is stale), new, or under --update updated."""
    reasons: list[str]
    """Why the case failed or improved (empty otherwise)."""
    current: dict[str, Any] | None
    baseline: dict[str, Any] | None
    search_time_s: float
    changes: list[str] = field(default_factory=list)
    """Old -> new of tokens/s, memory and the plan, against the baseline entry (`describe_changes`)."""

    @property
    def failed(self) -> bool:
        return self.status in _FAILING

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.case.name, "status": self.status, "reasons": self.reasons, "changes": self.changes,
                "case": asdict(self.case), "current": self.current, "baseline": self.baseline,
                "search_time_s": self.search_time_s}


_FAILING = frozenset({"fail", "improved"})
STATUSES = ("pass", "fail", "improved", "new", "updated")


def describe_changes(baseline: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Old -> new of tokens/s and peak memory (with the relative change), and of the plan when it changed."""
    old_tps, new_tps = float(baseline["tokens_per_s"]), float(current["tokens_per_s"])
    old_mem, new_mem = float(baseline["peak_memory_bytes"]), float(current["peak_memory_bytes"])
    changes = [f"tokens/s {old_tps:,.0f} -> {new_tps:,.0f}" + (f" ({new_tps / old_tps - 1:+.1%})" if old_tps else ""),
               f"memory {old_mem / 2**30:.2f} -> {new_mem / 2**30:.2f} GiB/GPU"
               + (f" ({new_mem / old_mem - 1:+.1%})" if old_mem else "")]
    if baseline.get("config") and current.get("config") and baseline["config"] != current["config"]:
        changes.append(f"plan {baseline['config']} -> {current['config']}")
    return changes


def compare(case: Case, current: dict[str, Any] | None, error: str | None, search_time_s: float,
            baseline: dict[str, Any] | None, tolerance: Tolerance, *, strict: bool = False,
            update: bool = False) -> CaseResult:
    """Judge one case against its baseline entry; see the module docstring. With `update` (the
    baseline is being rewritten) a case that has a plan is "updated", its drift only described."""
    reasons: list[str] = []
    if current is None:
        reasons.append(f"no plan found: {error}")
    elif not current["fits"]:
        reasons.append(f"best plan does not fit in memory ({current['peak_memory_bytes'] / 2**30:.2f} GiB/GPU)")
    if search_time_s > tolerance.search_time_s:
        reasons.append(f"search took {search_time_s:.2f} s, over the {tolerance.search_time_s:g} s budget")
    if baseline is None:
        if strict:
            reasons.append("case is not in the baseline (--strict)")
        status = "fail" if reasons else "new"
        return CaseResult(case, status, reasons, current, None, search_time_s)
    changes = describe_changes(baseline, current) if current is not None else []
    if update:
        return CaseResult(case, "fail" if reasons else "updated", reasons, current, dict(baseline), search_time_s,
                          changes)
    if current is not None:
        old_tps, new_tps = float(baseline["tokens_per_s"]), current["tokens_per_s"]
        if old_tps > 0 and new_tps < old_tps * (1 - tolerance.throughput):
            reasons.append(f"tokens/s dropped {1 - new_tps / old_tps:.1%} ({old_tps:,.0f} -> {new_tps:,.0f}; "
                           f"tolerance {tolerance.throughput:.1%})")
        old_mem, new_mem = float(baseline["peak_memory_bytes"]), current["peak_memory_bytes"]
        if old_mem > 0 and new_mem > old_mem * (1 + tolerance.memory):
            reasons.append(f"peak memory grew {new_mem / old_mem - 1:.1%} ({old_mem / 2**30:.2f} -> "
                           f"{new_mem / 2**30:.2f} GiB/GPU; tolerance {tolerance.memory:.1%})")
        if reasons:
            return CaseResult(case, "fail", reasons, current, dict(baseline), search_time_s, changes)
        # Drift the other way: the baseline no longer describes today's plans (module docstring).
        if old_tps > 0 and new_tps > old_tps * (1 + tolerance.throughput):
            reasons.append(f"tokens/s rose {new_tps / old_tps - 1:.1%} ({old_tps:,.0f} -> {new_tps:,.0f}; "
                           f"tolerance {tolerance.throughput:.1%})")
        if old_mem > 0 and new_mem < old_mem * (1 - tolerance.memory):
            reasons.append(f"peak memory fell {1 - new_mem / old_mem:.1%} ({old_mem / 2**30:.2f} -> "
                           f"{new_mem / 2**30:.2f} GiB/GPU; tolerance {tolerance.memory:.1%})")
        if reasons:
            reasons.append("the baseline is stale: refresh it with --update")
            return CaseResult(case, "improved", reasons, current, dict(baseline), search_time_s, changes)
    return CaseResult(case, "fail" if reasons else "pass", reasons, current, dict(baseline), search_time_s, changes)


@dataclass
class CheckReport:
    results: list[CaseResult]
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.results)

    @property
    def num_failed(self) -> int:
        return sum(r.failed for r in self.results)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "tolerance": asdict(self.tolerance),
                "counts": {s: self.count(s) for s in STATUSES},
                "cases": [r.to_dict() for r in self.results]}


Runner = Callable[[Case], tuple[dict[str, Any] | None, str | None, float]]


def run_check(suite: Suite, baseline: Mapping[str, Mapping[str, Any]] | None, *, strict: bool = False,
              runner: Runner = run_case, on_case: Callable[[CaseResult], None] | None = None,
              update: bool = False) -> CheckReport:
    """Run every case of `suite` and compare with `baseline` (None: every case is new); `update`:
    the baseline is being rewritten (`compare`)."""
    baseline = baseline or {}
    results = []
    for case in suite.cases:
        current, error, search_s = runner(case)
        result = compare(case, current, error, search_s, baseline.get(case.name), suite.tolerance, strict=strict,
                         update=update)
        results.append(result)
        if on_case is not None:
            on_case(result)
    return CheckReport(results, suite.tolerance)


# ---- reports ---------------------------------------------------------------------------------

def write_junit(path: str | os.PathLike, report: CheckReport, suite_name: str = "autoplan-check") -> None:
    """JUnit XML: one testcase per case, a <failure> with the reasons for each failed one."""
    root = ET.Element("testsuites")
    ts = ET.SubElement(root, "testsuite", name=suite_name, tests=str(len(report.results)),
                       failures=str(report.num_failed), errors="0", skipped="0",
                       time=f"{sum(r.search_time_s for r in report.results):.3f}")
    for r in report.results:
        tc = ET.SubElement(ts, "testcase", classname=suite_name, name=r.case.name, time=f"{r.search_time_s:.3f}")
        if r.failed:
            failure = ET.SubElement(tc, "failure", message="; ".join(r.reasons), type="PlanRegression")
            failure.text = "\n".join(r.reasons)
            if r.status == "improved":
                failure.set("type", "StaleBaseline")
        elif r.status == "new":
            ET.SubElement(tc, "system-out").text = "new case: not in the baseline"
    ET.indent(root)
    _atomic_write(Path(path), ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n")


def write_json(path: str | os.PathLike, report: CheckReport) -> None:
    _atomic_write(Path(path), json.dumps(report.to_dict(), indent=2) + "\n")


def report_table(report: CheckReport, *, only_failures: bool = False):
    """A rich table: case, status, tokens/s and memory against the baseline, reasons."""
    from rich.table import Table

    from autoplan.report.tables import fmt_bytes

    title = "plan-quality regressions" if only_failures else "autoplan check"
    table = Table(title=title)
    for name, justify in [("case", "left"), ("status", "left"), ("tokens/s", "right"), ("vs baseline", "right"),
                          ("mem/GPU", "right"), ("vs baseline", "right"), ("search", "right"), ("plan / reason", "left")]:
        table.add_column(name, justify=justify)
    style = _STYLE
    for r in report.results:
        if only_failures and not r.failed:
            continue
        cur, base = r.current, r.baseline
        tps = f"{cur['tokens_per_s']:,.0f}" if cur else "-"
        mem = fmt_bytes(cur["peak_memory_bytes"]) if cur else "-"
        d_tps = (f"{cur['tokens_per_s'] / base['tokens_per_s'] - 1:+.1%}"
                 if cur and base and base["tokens_per_s"] else "-")
        d_mem = (f"{cur['peak_memory_bytes'] / base['peak_memory_bytes'] - 1:+.1%}"
                 if cur and base and base["peak_memory_bytes"] else "-")
        detail = "; ".join(r.reasons) if r.reasons else (cur["config"] if cur else "")
        table.add_row(r.case.name, f"[{style[r.status]}]{r.status.upper()}[/]", tps, d_tps, mem, d_mem,
                      f"{r.search_time_s:.2f} s", detail)
    return table


_STYLE = {"pass": "green", "fail": "bold red", "improved": "bold cyan", "new": "yellow", "updated": "blue"}


def case_line(result: CaseResult) -> str:
    """The progress line of one case (rich markup): status, name, search time, and why it failed or
    improved, or what changed."""
    color = _STYLE[result.status].removeprefix("bold ")
    detail = result.reasons if result.status != "updated" else result.changes
    return (f"[{color}]{result.status.upper():4}[/] {result.case.name} ({result.search_time_s:.2f} s)"
            + (f": {'; '.join(detail)}" if detail else ""))


def run_command(args: Any, console: Any) -> int:
    """`autoplan check` over its parsed arguments (commands/plans.py): 0 when every case passes,
    1 on a regression or a stale baseline, 2 (a SuiteError) on a bad suite or baseline file."""
    suite = load_suite(args.suite)
    validate_case_specs(suite)
    if args.update and not args.baseline:
        raise SuiteError("--update needs --baseline FILE to write")
    baseline = None
    if args.baseline:
        baseline = load_previous_baseline(args.baseline) if args.update else load_baseline(args.baseline)
    report = run_check(suite, baseline, strict=args.strict, update=args.update,
                       on_case=lambda result: console.print(case_line(result)))
    if args.junit:
        write_junit(args.junit, report)
    if args.json_out:
        write_json(args.json_out, report)
    console.print(report_table(report))
    if args.update:
        written = write_baseline(args.baseline, report.results)
        missing = [r.case.name for r in report.results if r.current is None]
        console.print(f"wrote {written} case(s) to {args.baseline} ({report.count('updated')} updated, "
                      f"{report.count('new')} new)" + (f"; [red]no plan for {', '.join(missing)}[/red]" if missing else ""))
        return 1 if missing else 0
    if report.passed:
        console.print(f"[green]PASS[/green]: {report.count('pass')} within the tolerance, {report.count('new')} new"
                      + ("" if baseline is not None else " (no --baseline given)"))
        return 0
    regressed, improved = report.count("fail"), report.count("improved")
    parts = ([f"{regressed} of {len(report.results)} case(s) regressed"] if regressed else []) + (
        [f"{improved} of {len(report.results)} case(s) improved past the tolerance: refresh the baseline with "
         f"`autoplan check {args.suite} --baseline {args.baseline} --update`"] if improved else [])
    console.print(f"[red]FAIL[/red]: {'; '.join(parts)}")
    return 1
