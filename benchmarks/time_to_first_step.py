"""Time from `autoplan run` to the first step on 4 ranks, beside the floor of any 4-rank torch job.

Side by side, in one run, `--rounds` times each, alternating:
- floor: 4 spawned processes that import torch, join a gloo process group and pass a barrier (what
  any torch.distributed job pays before its first step on this machine);
- autoplan: `autoplan run plan.json --nproc 4 --steps 1` as a user types it, from the command's
  start to its `step 0` line, with the launcher's progress lines timed as they arrive.

Prints a table and the ratio of the medians; writes JSON (`--out`).

    python benchmarks/time_to_first_step.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "gpt:num_layers=8,hidden_size=256,num_heads=8,vocab_size=4096,max_seq_len=256"


def _floor_rank(rank: int, world_size: int, port: int) -> None:
    import torch  # noqa: F401 - the import is part of what is timed
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()


def floor_s(world_size: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    procs = [ctx.Process(target=_floor_rank, args=(r, world_size, port)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return time.perf_counter() - start


def autoplan_s(plan: Path) -> tuple[float, dict[str, float]]:
    """Seconds to the `step 0` line, and when each progress line arrived."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "autoplan", "run", str(plan), "--nproc", "4", "--steps", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict[str, float] = {}
    first_step = None
    for line in proc.stdout:
        now = time.perf_counter() - start
        if line.startswith("autoplan: ") and "error" not in line:
            marks[line.split(" after ")[0].removeprefix("autoplan: ").strip()] = now
        if line.startswith("step 0") and first_step is None:
            first_step = now
    proc.wait()
    if proc.returncode != 0 or first_step is None:
        raise SystemExit(f"autoplan run failed (exit {proc.returncode})")
    return first_step, marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/time_to_first_step.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", MODEL, "--cluster", "1x4xcpu",
                        "--global-batch", "8", "--seq-len", "256", "--pp", "4", "--dtype", "fp32", "--out", str(plan)],
                       check=True, capture_output=True)
        rounds = []
        for r in range(args.rounds):
            floor = floor_s(4)
            first, marks = autoplan_s(plan)
            rounds.append({"floor_s": floor, "autoplan_first_step_s": first, "progress_lines_s": marks})
            print(f"round {r}: floor {floor:.2f} s, autoplan first step {first:.2f} s; progress lines at "
                  + ", ".join(f"{v:.1f} s ({k})" for k, v in marks.items()), flush=True)
    floor_med = statistics.median(x["floor_s"] for x in rounds)
    first_med = statistics.median(x["autoplan_first_step_s"] for x in rounds)
    silent = [max(0.0, next(iter(x["progress_lines_s"].values()), x["autoplan_first_step_s"])) for x in rounds]
    print(f"\nmedian over {args.rounds} rounds: floor (4 ranks import torch + gloo barrier) {floor_med:.2f} s; "
          f"autoplan run to step 0 {first_med:.2f} s; ratio {first_med / floor_med:.2f}x; "
          f"first progress line after {statistics.median(silent):.2f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "ranks": 4, "rounds": rounds, "median_floor_s": floor_med,
                               "median_first_step_s": first_med, "ratio": first_med / floor_med}, indent=2))


if __name__ == "__main__":
    main()
