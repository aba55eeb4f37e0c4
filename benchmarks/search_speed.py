"""How fast `autoplan.suggest` answers, tracing and profiling included (timed after `import autoplan`).

    python benchmarks/search_speed.py [--json out.json]
    python benchmarks/search_speed.py --against ../other-checkout    # side by side: ratio of search times

`--against PATH [--repeats N]` runs each case's warm search under this checkout and under the
checkout at PATH in ONE process, both packages imported side by side, alternating A B B A for N
rounds (2N searches a side), and reports the ratio of the minima (CPU and wall), the median of the
paired ratios and the configurations each side evaluated (a change's effect on search time, on
the same machine in one run; e.g. `git worktree add ../before HEAD~5`). Separate processes in
turn were not enough on a loaded machine: two runs of the earlier form gave 1.12x and 1.48x for
the same pair of trees.

    python benchmarks/search_speed.py --against ../other-checkout --bytecodes   # the same, as work done

`--bytecodes` counts the Python bytecode instructions one warm search of each case executes under
each checkout (sys.settrace's opcode events, each side in a fresh process): a count that a loaded
machine does not change, beside the configurations each side evaluated. It misses time spent in C
(numpy, the simulator's arrays), so it is read beside the timings, not instead of them.

    python benchmarks/search_speed.py --ratio-only [--repeats 5]  # only the start-up ratio below

The start-up ratio (issue 29's target: within 1.5x): the cold `autoplan suggest` of gpt3-175b on
128 x 8 A100-80GB as a user types it (a fresh process, an empty AUTOPLAN_CACHE_DIR) against
`python -c "import torch"`, each run `--repeats` times in alternation, medians of wall time and
of the child's CPU time (user + sys; on a loaded machine the CPU ratio is the steadier one). A
built-in model's cold run reads its shipped profile ([Note: shipped profiles] in
autoplan/graph/profile_cache.py); "unshipped" is the same cold run with AUTOPLAN_SHIPPED_PROFILES=0,
what the first run of a model without a shipped profile pays (the fake-tensor profile, torch._dynamo's
import included).

Cases: gpt3-175b on 128 x 8 A100-80GB (global batch 1536, seq 2048; target 2 s on a 2-core machine),
and a 16k-GPU case, llama3-405b on 2048 x 8 H100-80GB (global batch 2048, seq 8192).

Every measurement is a fresh Python process (imports, torch's lazy imports and caches start cold):
- cold: an empty profile cache (AUTOPLAN_CACHE_DIR points at a new temporary directory), so the
  model is traced and its shipped profile read (both cases are built-in models at a shipped length),
  or, without one (AUTOPLAN_SHIPPED_PROFILES=0), profiled on fake tensors;
- warm: the same directory again, holding the analytic profile a cold run that profiled wrote, so
  the model is built and traced but not profiled.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CASES = [
    ("gpt3-175b", "128x8xA100-80GB", 1536, 2048),
    ("llama3-405b", "2048x8xH100-80GB", 2048, 8192),
]


def _one(model: str, cluster: str, batch: int, seq: int) -> dict:
    """Run one case in this process and describe it (called in a child process)."""
    import autoplan  # noqa: F401  (imported before the clock starts, as the target says)

    started = time.perf_counter()
    from autoplan.api import suggest_with_stats

    result, _ = suggest_with_stats(model, cluster, global_batch=batch, seq_len=seq, top=5)
    total = time.perf_counter() - started
    best = result.plans[0]
    return {"model": model, "cluster": cluster, "gpus": best.num_gpus, "total_s": total, "search_s": result.time_s,
            "configs_evaluated": result.configs_evaluated,
            "configs_per_s": result.configs_evaluated / result.time_s,
            "best": f"tp{best.tp} pp{best.pp} dp{best.dp} {best.schedule} mfu {best.predicted.mfu:.1%}"}


def _child(case: tuple, cache_dir: str) -> dict:
    env = dict(os.environ, AUTOPLAN_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_INTERLEAVED = r"""
import json, statistics, sys, time
roots = {roots!r}
model, cluster, batch, seq = {case!r}
fns, mods = {{}}, {{}}

def _ours():
    return [k for k in sys.modules if k == "autoplan" or k.startswith("autoplan.")]

for name, root in roots.items():  # each checkout's package imported under the same name, kept apart
    for k in _ours():
        del sys.modules[k]
    sys.path.insert(0, root)
    import autoplan.api
    assert autoplan.api.__file__.startswith(root), (root, autoplan.api.__file__)
    fns[name] = autoplan.api.suggest_with_stats
    result = None
    for _ in range(2):  # warm: the profile built and cached, lazy imports done
        result, _ = fns[name](model, cluster, global_batch=batch, seq_len=seq, top=5)
    mods[name] = {{k: sys.modules[k] for k in _ours()}}
    sys.path.remove(root)
    best = result.plans[0]
    mods[name + ":about"] = (result.configs_evaluated, f"tp{{best.tp}} pp{{best.pp}} dp{{best.dp}} {{best.schedule}}")

times = {{name: [] for name in roots}}

def one(name):
    for k in _ours():
        del sys.modules[k]
    sys.modules.update(mods[name])  # the lazy imports inside the search find this checkout's modules
    wall, cpu = time.perf_counter(), time.process_time()
    fns[name](model, cluster, global_batch=batch, seq_len=seq, top=5)
    times[name].append((time.perf_counter() - wall, time.process_time() - cpu))

for i in range({rounds}):  # A B B A, then B A A B: a drift in the machine's load hits both alike
    order = ("this", "other", "other", "this") if i % 2 == 0 else ("other", "this", "this", "other")
    for name in order:
        one(name)
print(json.dumps({{"times": times, "about": {{k: mods[k + ":about"] for k in roots}}}}))
"""


def compare(other: str, rounds: int) -> int:
    """Warm searches of each case under this checkout and the one at `other`, in ONE process,
    alternating A B B A for `rounds` rounds (2 searches of each side a round): both sides see the same
    machine at a granularity of one search, which separate processes on a loaded machine do not.
    Prints the minima (the search's cost when it had a core to itself), the median of the paired
    ratios (the k-th search of each side, adjacent in time) and the work each side did."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"{'model':<12} {'cluster':<18} {'side':<6} {'configs':>7} {'min cpu s':>9} {'min wall s':>10} "
          f"{'med cpu s':>9}  best plan")
    out = []
    for case in CASES:
        code = _INTERLEAVED.format(roots={"this": here, "other": other}, case=list(case), rounds=rounds)
        with tempfile.TemporaryDirectory(prefix="autoplan-bench-") as cache_dir:
            env = dict(os.environ, AUTOPLAN_CACHE_DIR=cache_dir)
            env.pop("PYTHONPATH", None)
            run = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                                 cwd=tempfile.gettempdir())
        result = json.loads(run.stdout.strip().splitlines()[-1])
        times, about = result["times"], result["about"]
        for side in ("this", "other"):
            cpu = [c for _, c in times[side]]
            print(f"{case[0]:<12} {case[1]:<18} {side:<6} {about[side][0]:>7} {min(cpu):>9.3f} "
                  f"{min(w for w, _ in times[side]):>10.3f} {statistics.median(cpu):>9.3f}  {about[side][1]}")
        ratio = {key: min(t[i] for t in times["this"]) / min(t[i] for t in times["other"])
                 for i, key in ((0, "wall"), (1, "cpu"))}
        paired = statistics.median(a[1] / b[1] for a, b in zip(times["this"], times["other"], strict=True))
        work = about["this"][0] / about["other"][0]
        print(f"{'':<12} {'':<18} this / other: minima cpu {ratio['cpu']:.3f}, wall {ratio['wall']:.3f}; paired cpu "
              f"median {paired:.3f}; configurations evaluated {work:.3f}; min cpu per configuration "
              f"{ratio['cpu'] / work:.3f} ({len(times['this'])} searches a side)")
        out.append({"case": list(case), "times": times, "about": about, "ratio_of_minima": ratio,
                    "paired_cpu_median": paired})
    return out


_BYTECODES = r"""
import json, sys
root = {root!r}
sys.path.insert(0, root)
import autoplan.api
assert autoplan.api.__file__.startswith(root), (root, autoplan.api.__file__)
model, cluster, batch, seq = {case!r}
for _ in range(2):  # warm: the profile built and cached, lazy imports done
    autoplan.api.suggest_with_stats(model, cluster, global_batch=batch, seq_len=seq, top=5)
count = [0]

def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        count[0] += 1
    return tracer

sys.settrace(tracer)
result, _ = autoplan.api.suggest_with_stats(model, cluster, global_batch=batch, seq_len=seq, top=5)
sys.settrace(None)
print(json.dumps({{"bytecodes": count[0], "configs": result.configs_evaluated}}))
"""


def compare_bytecodes(other: str) -> list[dict]:
    """Bytecode instructions of one warm search of each case under this checkout and the one at `other`
    (each in a fresh process with its own profile cache): the work each side does, whatever the load."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"{'model':<12} {'cluster':<18} {'this bytecodes':>14} {'other':>12} {'ratio':>6} {'configs':>13} "
          f"{'per config':>10}")
    out = []
    for case in CASES:
        counts = {}
        for side, root in (("this", here), ("other", other)):
            with tempfile.TemporaryDirectory(prefix="autoplan-bench-") as cache_dir:
                # One string hash seed for both: a set's order may change the count otherwise.
                env = dict(os.environ, AUTOPLAN_CACHE_DIR=cache_dir, PYTHONHASHSEED="0")
                env.pop("PYTHONPATH", None)
                run = subprocess.run([sys.executable, "-c", _BYTECODES.format(root=root, case=list(case))], env=env,
                                     check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
            counts[side] = json.loads(run.stdout.strip().splitlines()[-1])
        ratio = counts["this"]["bytecodes"] / counts["other"]["bytecodes"]
        work = counts["this"]["configs"] / counts["other"]["configs"]
        print(f"{case[0]:<12} {case[1]:<18} {counts['this']['bytecodes']:>14,} {counts['other']['bytecodes']:>12,} "
              f"{ratio:>6.3f} {counts['this']['configs']:>6}/{counts['other']['configs']:<6} {ratio / work:>10.3f}")
        out.append({"case": list(case), "counts": counts, "ratio": ratio})
    return out


RATIO_COMMAND = ["suggest", "--model", "gpt3-175b", "--cluster", "128x8xA100-80GB", "--global-batch", "1536",
                 "--seq-len", "2048"]


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + sys) seconds of one fresh child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=tempfile.gettempdir())
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def startup_ratio(repeats: int) -> dict:
    """`autoplan suggest` (gpt3-175b, 1024 A100) in a fresh process against `python -c "import torch"`:
    medians, cold (an empty profile cache: the first run of a model) and warm (the cache the cold run
    wrote: every later run of that model, a fresh process all the same)."""
    runs: dict[str, list[tuple[float, float]]] = {"torch": [], "cold": [], "warm": [], "unshipped": []}
    for _ in range(repeats):  # alternating, so that a change in the machine's load hits all alike
        runs["torch"].append(_timed([sys.executable, "-c", "import torch"], dict(os.environ)))
        with tempfile.TemporaryDirectory(prefix="autoplan-cold-") as cache_dir:
            env = dict(os.environ, AUTOPLAN_CACHE_DIR=cache_dir, AUTOPLAN_SHIPPED_PROFILES="1")
            runs["cold"].append(_timed([sys.executable, "-m", "autoplan", *RATIO_COMMAND], env))
            runs["warm"].append(_timed([sys.executable, "-m", "autoplan", *RATIO_COMMAND], env))
        with tempfile.TemporaryDirectory(prefix="autoplan-unshipped-") as cache_dir:
            env = dict(os.environ, AUTOPLAN_CACHE_DIR=cache_dir, AUTOPLAN_SHIPPED_PROFILES="0")
            runs["unshipped"].append(_timed([sys.executable, "-m", "autoplan", *RATIO_COMMAND], env))
    med = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for name, r in runs.items()}
    return {"command": "autoplan " + " ".join(RATIO_COMMAND), "repeats": repeats,
            "import_torch_wall_s": med["torch"][0], "import_torch_cpu_s": med["torch"][1],
            "cold_suggest_wall_s": med["cold"][0], "cold_suggest_cpu_s": med["cold"][1],
            "wall_ratio": med["cold"][0] / med["torch"][0], "cpu_ratio": med["cold"][1] / med["torch"][1],
            "warm_suggest_wall_s": med["warm"][0], "warm_suggest_cpu_s": med["warm"][1],
            "warm_wall_ratio": med["warm"][0] / med["torch"][0], "warm_cpu_ratio": med["warm"][1] / med["torch"][1],
            "unshipped_suggest_wall_s": med["unshipped"][0], "unshipped_suggest_cpu_s": med["unshipped"][1],
            "unshipped_wall_ratio": med["unshipped"][0] / med["torch"][0],
            "unshipped_cpu_ratio": med["unshipped"][1] / med["torch"][1]}


def print_ratio(ratio: dict) -> None:
    print(f"`{ratio['command']}` against `python -c \"import torch\"` (fresh processes, median of "
          f"{ratio['repeats']}; cold: an empty profile cache, warm: the cache the cold run wrote, unshipped: "
          f"cold without the shipped profiles):")
    print(f"{'':<16} {'torch s':>8} {'cold s':>8} {'ratio':>6} {'warm s':>8} {'ratio':>6} {'unship s':>8} {'ratio':>6}")
    for label, key in (("wall", "wall"), ("cpu (user+sys)", "cpu")):
        print(f"{label:<16} {ratio[f'import_torch_{key}_s']:>8.2f} {ratio[f'cold_suggest_{key}_s']:>8.2f} "
              f"{ratio[f'{key}_ratio']:>6.2f} {ratio[f'warm_suggest_{key}_s']:>8.2f} {ratio[f'warm_{key}_ratio']:>6.2f} "
              f"{ratio[f'unshipped_suggest_{key}_s']:>8.2f} {ratio[f'unshipped_{key}_ratio']:>6.2f}")
    print("target: ratio within 1.5 (issue 29)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--against", metavar="PATH", help="another checkout to compare search times with")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of each side of the start-up ratio; with --against, rounds of A B B A (default 5)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="with --against: count the bytecodes of one warm search a side instead of timing")
    parser.add_argument("--ratio-only", action="store_true", help="only the start-up ratio, not the cases")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one case, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(*json.loads(args.one))))
        return 0
    if args.against:
        compared = compare_bytecodes if args.bytecodes else functools.partial(compare, rounds=args.repeats)
        rows = compared(os.path.abspath(args.against))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"against": os.path.abspath(args.against), "cases": rows}, f, indent=2)
        return 0
    if args.ratio_only:
        ratio = startup_ratio(args.repeats)
        print_ratio(ratio)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"startup_ratio": ratio}, f, indent=2)
        return 0

    rows = []
    print(f"{'model':<12} {'cluster':<18} {'GPUs':>6} {'cold s':>7} {'warm s':>7} {'search s':>9} {'evaluated':>9} "
          f"{'configs/s':>9}  best plan")
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix="autoplan-bench-") as cache_dir:
            cold = _child(case, cache_dir)
            warm = _child(case, cache_dir)
        if warm["best"] != cold["best"]:
            print(f"warning: the warm run chose {warm['best']}, the cold run {cold['best']}", file=sys.stderr)
        print(f"{cold['model']:<12} {cold['cluster']:<18} {cold['gpus']:>6} {cold['total_s']:>7.2f} "
              f"{warm['total_s']:>7.2f} {cold['search_s']:>9.2f} {cold['configs_evaluated']:>9} "
              f"{cold['configs_per_s']:>9.0f}  {cold['best']}")
        rows.append({**cold, "cold_total_s": cold["total_s"], "warm_total_s": warm["total_s"],
                     "warm_search_s": warm["search_s"]})
    print("target: gpt3-175b on 1024 GPUs within 2 s, profiling included (cold: empty profile cache; warm: the "
          "analytic profile cached on disk; each a fresh process)")
    print()
    ratio = startup_ratio(args.repeats)
    print_ratio(ratio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": rows, "startup_ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
