"""How `autoplan run` ends when things go wrong, measured on CPU (gloo, 4 ranks, pp 2 x dp 2):
docs/reliability.md quotes these figures.

    python benchmarks/faults_cpu.py [--repeats 5] [--out benchmarks/results/faults_cpu.json]

For each fault, `repeats` runs through the CLI (`python -m autoplan run plan.json`, a plan written by
`autoplan suggest --out`), and per run: the exit code; the seconds to the launcher's exit counted
from the launch (start-up takes about 5 s on 2 cores, the fault strikes at step 3, --timeout 5), or
for a killed launcher from the signal to the last rank gone; whether the last line names the right
rank. Faults: the launcher SIGKILLed and SIGTERMed mid-run (its ranks must go with it), a rank frozen
(SIGSTOP, each rank in turn), a rank hung in Python, a NaN gradient.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT = "gpt:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
TIMEOUT_S = 5


def _autoplan(args: list[str], tmpdir: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autoplan", *args], env={**os.environ, "TMPDIR": str(tmpdir),
                            **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _beats(tmpdir: Path) -> dict[int, dict]:
    out = {}
    for path in tmpdir.glob("autoplan-rank-*/heartbeat-*.json"):
        with contextlib.suppress(OSError, ValueError):  # a beat being replaced
            out[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _until_step(tmpdir: Path, step: int) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        beats = _beats(tmpdir)
        if len(beats) == 4 and all((b.get("step") or 0) >= step for b in beats.values()):
            return [b["pid"] for b in beats.values()]
        time.sleep(0.1)
    raise RuntimeError("the job did not start")


def kill_launcher(plan: Path, tmp: Path, sig: signal.Signals) -> dict:
    job = _autoplan(["run", str(plan), "--steps", "100000"], tmp)
    ranks = _until_step(tmp, 2)
    start = time.monotonic()
    job.send_signal(sig)
    job.wait(30)
    while any(map(_alive, ranks)) and time.monotonic() - start < 60:
        time.sleep(0.02)
    return {"exit": job.returncode, "seconds_to_all_gone": round(time.monotonic() - start, 2),
            "ranks_left": sum(map(_alive, ranks))}


def rank_fault(plan: Path, tmp: Path, fault: str, expect: str) -> dict:
    start = time.monotonic()
    job = _autoplan(["run", str(plan), "--steps", "50", "--timeout", str(TIMEOUT_S)], tmp, {"AUTOPLAN_FAULT": fault})
    _, err = job.communicate(timeout=300)
    line = err.strip().splitlines()[-1] if err.strip() else ""
    return {"exit": job.returncode, "seconds_to_exit": round(time.monotonic() - start, 2),
            "named": re.match(expect, line) is not None, "line": line[:200]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "faults_cpu.json"))
    args = parser.parse_args()
    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as root:
        plan = Path(root) / "p.json"
        subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", GPT, "--cluster", "1x4xA100-80GB",
                        "--global-batch", "8", "--pp", "2", "--dp", "2", "--tp", "1", "--zero", "0", "--schedule",
                        "1f1b", "--out", str(plan)], check=True, capture_output=True)
        cases = [("launcher SIGKILL", lambda t: kill_launcher(plan, t, signal.SIGKILL)),
                 ("launcher SIGTERM", lambda t: kill_launcher(plan, t, signal.SIGTERM))]
        cases += [(f"rank {r} frozen (SIGSTOP)", lambda t, r=r: rank_fault(
            plan, t, f"stop@{r}:3", f"autoplan: error: rank {r} stopped making progress")) for r in range(4)]
        cases += [("rank 1 hung in Python", lambda t: rank_fault(
            plan, t, "hang@1:3", "autoplan: error: rank 1 stopped making progress")),
            ("NaN gradient on rank 2", lambda t: rank_fault(
                plan, t, "nan@2:3", r"autoplan: error: rank \d failed: NonFiniteError: non-finite gradients in stage 1 "
                                    r"at step 3"))]
        for name, case in cases:
            results[name] = []
            for i in range(args.repeats):
                tmp = Path(root) / f"{len(results)}-{i}"
                tmp.mkdir()
                results[name].append(case(tmp))
            print(name, [(r["exit"], r.get("seconds_to_all_gone", r.get("seconds_to_exit")), r.get("named", True))
                         for r in results[name]], flush=True)
    summary = {name: {"runs": len(rs), "exit_codes": sorted({r["exit"] for r in rs}),
                      "max_seconds": max(r.get("seconds_to_all_gone", r.get("seconds_to_exit")) for r in rs),
                      "named_right": sum(r.get("named", r.get("ranks_left") == 0) for r in rs)}
               for name, rs in results.items()}
    Path(args.out).write_text(json.dumps({"timeout_s": TIMEOUT_S, "summary": summary, "runs": results}, indent=1))
    for name, s in summary.items():
        print(f"{name:28s} {s['named_right']}/{s['runs']} right, exit {s['exit_codes']}, at most {s['max_seconds']} s")


if __name__ == "__main__":
    main()
