"""The default test tier's summed time from a JUnit XML of a full default run, before and after the
cases tests/conftest.py moves to the `extended` tier ([Note: test tiers]).

    python -m pytest --junitxml=run.xml           # the README's test command, with a report
    python benchmarks/tier_times.py run.xml [--top 30]

Prints the total, what EXTENDED_CASES takes out of it, the slowest cases left in the default tier
and the time per file. Times are the machine's: compare runs on the same machine and load.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def node_id(classname: str, name: str) -> str:
    """pytest's node id of a JUnit testcase: tests.test_x.TestY + name -> tests/test_x.py::TestY::name."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[i:], name])
    return f"{classname}::{name}"


def load(junit: str) -> list[tuple[str, float, str]]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        status = "skipped" if case.find("skipped") is not None else "failed" if failed else "passed"
        rows.append((node_id(case.get("classname", ""), case.get("name", "")), float(case.get("time", 0)), status))
    return rows


def extended_cases() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("autoplan_tests_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXTENDED_CASES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="JUnit XML of a default run (`python -m pytest --junitxml=FILE`)")
    parser.add_argument("--top", type=int, default=30, help="slowest default-tier cases to list (default 30)")
    args = parser.parse_args()
    rows = load(args.junit)
    moved = extended_cases()
    total = sum(t for _, t, _ in rows)
    out = sum(t for n, t, _ in rows if n in moved)
    kept = [(n, t, s) for n, t, s in rows if n not in moved]
    print(f"{len(rows)} cases, {total:.0f} s ({total / 60:.1f} min); EXTENDED_CASES present: "
          f"{sum(n in moved for n, _, _ in rows)} of {len(moved)}, {out:.0f} s; default tier now {total - out:.0f} s "
          f"({(total - out) / 60:.1f} min)")
    print(f"\nslowest {args.top} left in the default tier:")
    for n, t, s in sorted(kept, key=lambda r: -r[1])[: args.top]:
        print(f"{t:8.1f} {s:<7} {n}")
    per_file = collections.Counter()
    for n, t, _ in kept:
        per_file[n.split("::")[0]] += t
    print("\nper file (default tier):")
    for path, t in per_file.most_common(20):
        print(f"{t:8.1f} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
