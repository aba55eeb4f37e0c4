"""Compare autoplan's predictions with the published Megatron-LM runs (Narayanan et al. SC'21, Table 1).

For each row: the paper's GPT (vocab 51200, seq 2048, ffn 4h) on gpus/8 DGX A100 nodes, with tp, pp,
dp pinned as published, interleaved 1F1B and full recompute; micro-batch size and virtual stages
are left to the search (the paper does not publish them). The prediction is converted to the
paper's own FLOP convention, F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per step, so the two
TFLOP/s figures count the same FLOPs and compare step times directly.

    python benchmarks/validate_published.py              # the table (and --json out.json)
    python benchmarks/validate_published.py --free       # also: the unpinned search vs the published config
    python benchmarks/validate_published.py --fit        # grid-search the efficiency constants (docs/calibration.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import autoplan.cost.time as cost_time
from autoplan.cluster import parse_cluster
from autoplan.graph import zoo
from autoplan.graph.profile import profile_model
from autoplan.plan import Job
from autoplan.search.space import search_plans

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "megatron_sc21_table1.json"


def _load(path: Path) -> dict:
    if not path.exists():
        sys.exit(f"validate_published: {path} not found; pass --data PATH")
    return json.loads(path.read_text())


def _published_flops(row: dict, seq: int, vocab: int) -> float:
    b, h, layers = row["global_batch"], row["hidden"], row["layers"]
    return 96 * b * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def _profile(row: dict, seq: int, vocab: int):
    spec = (f"gpt:num_layers={row['layers']},hidden_size={row['hidden']},num_heads={row['heads']},"
            f"vocab_size={vocab},max_seq_len={seq}")
    model = zoo.build_model(spec)
    prof, _ = profile_model(model, zoo.example_inputs(spec, 1, seq), loss_fn=zoo.lm_loss,
                            example_target=zoo.example_targets(spec, 1, seq), model_name=spec,
                            info={k: v for k, v in zoo.model_info(spec).items() if isinstance(v, int)})
    return spec, prof


def evaluate_rows(rows: list[dict], profiles: dict, seq: int, vocab: int, free: bool = False) -> list[dict]:
    out = []
    for row in rows:
        spec, prof = profiles[row["params_billion"]]
        cluster = parse_cluster(f"{row['gpus'] // 8}x8xA100-80GB")
        job = Job(global_batch=row["global_batch"], seq_len=seq, dtype="bfloat16")
        dp = row["gpus"] // (row["tp"] * row["pp"])
        pins = {"tp": row["tp"], "pp": row["pp"], "dp": dp, "recompute": "full",
                "schedule": "interleaved-1f1b" if row["pp"] > 1 else "1f1b"}
        started = time.perf_counter()
        plan = search_plans(prof, cluster, job, model_spec=spec, top=1, pins=pins).plans[0]
        flops = _published_flops(row, seq, vocab)
        predicted = flops / (row["gpus"] * plan.predicted.step_time_s) / 1e12
        entry = {
            "params_billion": row["params_billion"], "gpus": row["gpus"], "tp": row["tp"], "pp": row["pp"], "dp": dp,
            "published_tflops": row["tflops_per_gpu"], "predicted_tflops": predicted,
            "error": predicted / row["tflops_per_gpu"] - 1,
            "autoplan_hw_tflops": plan.predicted.hardware_tflops_per_gpu,
            "micro_batch_size": plan.micro_batch_size, "virtual_stages": plan.virtual_stages, "fits": plan.fits,
            "step_time_s": plan.predicted.step_time_s,
            "published_step_time_s": flops / (row["gpus"] * row["tflops_per_gpu"] * 1e12),
            "search_s": time.perf_counter() - started,
        }
        if free:
            best = search_plans(prof, cluster, job, model_spec=spec, top=1).plans[0]
            entry["free_step_time_s"] = best.predicted.step_time_s
            entry["free_plan"] = (f"tp{best.tp} pp{best.pp} dp{best.dp} mbs{best.micro_batch_size} {best.schedule}"
                                  f" v{best.virtual_stages} {best.recompute}")
            entry["free_at_least_as_fast"] = best.predicted.step_time_s <= plan.predicted.step_time_s * (1 + 1e-9)
        out.append(entry)
    return out


_PARAMS = ("E_GEMM", "W_HALF", "E_ATTENTION")


def _score(rows, profiles, seq, vocab) -> tuple[float, float]:
    errors = [r["error"] for r in evaluate_rows(rows, profiles, seq, vocab)]
    return max(abs(e) for e in errors), abs(statistics.median(errors))


def _fit(rows, profiles, seq, vocab) -> None:
    """Coordinate search on (E_GEMM, W_HALF, E_ATTENTION), minimizing the worst |error|, then the
    |median error|: halve the step of a parameter when neither direction improves."""
    steps = {"E_GEMM": 0.05, "W_HALF": 200.0, "E_ATTENTION": 0.05}
    lower = {"E_GEMM": 0.2, "W_HALF": 0.0, "E_ATTENTION": 0.02}
    upper = {"E_GEMM": 0.95, "W_HALF": 5000.0, "E_ATTENTION": 0.95}
    best = _score(rows, profiles, seq, vocab)
    for _ in range(6):
        for name in _PARAMS:
            improved = True
            while improved:
                improved = False
                for sign in (1, -1):
                    old = getattr(cost_time, name)
                    new = min(max(old + sign * steps[name], lower[name]), upper[name])
                    setattr(cost_time, name, new)
                    score = _score(rows, profiles, seq, vocab)
                    if score < best:
                        best, improved = score, True
                        print(f"  {name}={new:.4g}: worst {score[0]:.1%} median {score[1]:.1%}", flush=True)
                        break
                    setattr(cost_time, name, old)
            steps[name] /= 2
    print("fit: " + " ".join(f"{n}={getattr(cost_time, n):.4g}" for n in _PARAMS)
          + f": worst |error| {best[0]:.1%}, |median error| {best[1]:.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--free", action="store_true", help="also run the unpinned search per row")
    parser.add_argument("--fit", action="store_true", help="grid-search E_MAX and W_HALF")
    args = parser.parse_args()
    data = _load(args.data)
    seq, vocab = data["common"]["seq_len"], data["common"]["vocab_size"]
    rows = [dict(zip(data["columns"], r, strict=True)) for r in data["rows"]]
    profiles = {row["params_billion"]: _profile(row, seq, vocab) for row in rows}

    if args.fit:
        _fit(rows, profiles, seq, vocab)

    results = evaluate_rows(rows, profiles, seq, vocab, free=args.free)
    header = f"{'params':>8} {'gpus':>5} {'tp':>3} {'pp':>3} {'dp':>4} {'mbs':>4} {'v':>3} {'published':>10} {'predicted':>10} {'error':>7}"
    if args.free:
        header += f"  {'free search / published config':>32}"
    print(f"GEMM efficiency {cost_time.E_GEMM:.4g} * w / (w + {cost_time.W_HALF:.4g}), w = hidden / tp; "
          f"attention-core efficiency {cost_time.E_ATTENTION:.4g}")
    print(header)
    for r in results:
        line = (f"{r['params_billion']:>7.1f}B {r['gpus']:>5} {r['tp']:>3} {r['pp']:>3} {r['dp']:>4} "
                f"{r['micro_batch_size']:>4} {r['virtual_stages']:>3} {r['published_tflops']:>10.1f} "
                f"{r['predicted_tflops']:>10.1f} {r['error']:>+7.1%}")
        if args.free:
            line += f"  {r['free_step_time_s'] / r['step_time_s']:>8.3f}x ({r['free_plan']})"
        print(line)
    errors = [r["error"] for r in results]
    print(f"worst |error| {max(abs(e) for e in errors):.1%} (target 10%), median error {statistics.median(errors):+.1%}"
          f" (target within 5%)")
    if args.free:
        print(f"free search at least as fast as the published configuration on "
              f"{sum(r['free_at_least_as_fast'] for r in results)}/{len(results)} rows")
    if args.json:
        constants = {n: getattr(cost_time, n) for n in _PARAMS}
        args.json.write_text(json.dumps({"constants": constants, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
