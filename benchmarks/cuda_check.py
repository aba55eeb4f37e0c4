"""On one CUDA GPU: timed block profiles against the analytic cost model, and one-GPU plans run end to end.

    python benchmarks/cuda_check.py [--gpu H100-SXM-80GB] [--steps 8] [--json out.json]

Part 1 (profiles): for a few zoo models at micro-batch 1 and 2, sequence 2048, bf16, every block
is timed on the GPU (`autoplan.profile(..., device="cuda")`, forward and backward, CUDA events) and
set beside the analytic prediction of the cost model for the same GPU (FLOPs over calibrated
achievable throughput, cost/time.py). Printed per block kind: measured and predicted milliseconds
and predicted / measured.

Part 2 (end to end, NCCL, one rank): `autoplan.suggest` plans a model on `1x1x<gpu>` twice (from the
analytic profile, and from the profile timed on this GPU), and each plan is trained for `--steps`
steps through `autoplan.partition` (the executor, AdamW), with a recompute=full variant pinned too.
Printed per plan: predicted and measured median step time (after 2 warm-up steps), and predicted
and measured peak memory (`torch.cuda.max_memory_allocated` above what was allocated before the
plan was built; the prediction includes the allowance for CUDA context, NCCL and fragmentation,
which the allocator's count does not see). Then `autoplan run --nproc 1` runs
the first plan through the CLI, to show the launcher path on NCCL.

Needs CUDA; exits 2 with a message where there is none.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROFILE_CASES = [  # (spec, micro-batch sizes)
    ("gpt3-1.3b:num_layers=2", (1, 2)),
    ("gpt3-13b:num_layers=2", (1, 2)),
    ("llama3-8b:num_layers=2", (1, 2)),
]
SEQ = 2048
RUN_MODEL = "gpt3-1.3b"
RUN_BATCH = 16


def _block_rows(spec: str, batch: int, gpu_name: str) -> list[dict]:
    import autoplan
    from autoplan.cluster import parse_cluster
    from autoplan.cost.config import ParallelConfig
    from autoplan.cost.time import block_times

    analytic = autoplan.profile(spec, batch_size=batch, seq_len=SEQ, dtype="bf16")
    timed = autoplan.profile(spec, batch_size=batch, seq_len=SEQ, dtype="bf16", device="cuda")
    cluster = parse_cluster(f"1x1x{gpu_name}")
    cfg = ParallelConfig(tp=1, pp=1, dp=1, micro_batch_size=batch, num_microbatches=1, schedule="1f1b")
    predicted = block_times(analytic, cluster.gpu_types[0], cluster, cfg, "bfloat16")
    rows = []
    for i, (a, t) in enumerate(zip(analytic.blocks, timed.blocks)):
        rows.append({"model": spec, "batch": batch, "block": i, "name": a.name, "kind": a.kind,
                     "fwd_flops": a.fwd_flops, "measured_fwd_ms": 1e3 * t.fwd_time_s,
                     "predicted_fwd_ms": 1e3 * float(predicted.fwd_s[i]), "measured_bwd_ms": 1e3 * t.bwd_time_s,
                     "predicted_bwd_ms": 1e3 * float(predicted.bwd_s[i])})
    return rows


def _print_blocks(rows: list[dict]) -> None:
    print(f"{'model':<24} {'mb':>2} {'block':<16} {'kind':<9} {'fwd ms':>8} {'pred':>8} {'ratio':>6} "
          f"{'bwd ms':>8} {'pred':>8} {'ratio':>6} {'meas TFLOP/s':>12}")
    seen = set()
    for r in rows:
        key = (r["model"], r["batch"], r["kind"])
        if key in seen:
            continue  # one row per kind: repeated layers time the same
        seen.add(key)
        tflops = r["fwd_flops"] / (r["measured_fwd_ms"] / 1e3) / 1e12 if r["measured_fwd_ms"] else 0.0
        print(f"{r['model']:<24} {r['batch']:>2} {r['name'][:16]:<16} {r['kind']:<9} "
              f"{r['measured_fwd_ms']:>8.3f} {r['predicted_fwd_ms']:>8.3f} {r['predicted_fwd_ms'] / r['measured_fwd_ms']:>6.2f} "
              f"{r['measured_bwd_ms']:>8.3f} {r['predicted_bwd_ms']:>8.3f} {r['predicted_bwd_ms'] / r['measured_bwd_ms']:>6.2f} "
              f"{tflops:>12.1f}")


def _train(plan, steps: int) -> dict:
    """Train `plan` in this process (one NCCL rank) and measure step time and peak memory."""
    import torch

    from autoplan import models as zoo
    from autoplan.runtime import partition
    from autoplan.runtime.launcher.training import synthetic_batch

    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(device)  # whatever earlier parts left behind
    torch.cuda.reset_peak_memory_stats(device)
    pm = partition(plan.model, plan, device=device)
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-4, fused=True)  # as `autoplan run` on CUDA
    vocab = zoo.model_info(plan.model)["vocab_size"]
    times, losses = [], []
    for step in range(steps):
        ids, targets = synthetic_batch(0, step, plan.job.global_batch, plan.job.seq_len, vocab)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = pm.step(ids, target=targets)
        optimizer.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        optimizer.step()
    torch.cuda.synchronize(device)
    optimizer_s = (time.perf_counter() - start) / 3
    del pm, optimizer
    torch.cuda.empty_cache()
    return {"measured_step_s": statistics.median(times[2:]), "peak_memory_bytes": peak, "losses": losses,
            "measured_optimizer_s": optimizer_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100-SXM-80GB", help="autoplan GPU name of this device")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json")
    parser.add_argument("--skip-profiles", action="store_true")
    parser.add_argument("--blocks", action="store_true", help="print every block of the run's timed profile")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("autoplan: error: no CUDA device; run this on a machine with a GPU", file=sys.stderr)
        return 2
    import torch.distributed as dist

    import autoplan
    from autoplan.api import suggest_with_stats

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, planning for {args.gpu}", flush=True)
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gpu": args.gpu}

    if not args.skip_profiles:
        rows = []
        for spec, batches in PROFILE_CASES:
            for b in batches:
                rows += _block_rows(spec, b, args.gpu)
        _print_blocks(rows)
        out["blocks"] = rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cluster = f"1x1x{args.gpu}"
    runs, plans = [], []
    variants = [("analytic", "meta", {}), ("timed", "cuda", {}), ("analytic, full recompute", "meta",
                                                                 {"recompute": "full"})]
    for label, profile_device, pins in variants:
        result, profiled = suggest_with_stats(RUN_MODEL, cluster, global_batch=RUN_BATCH, seq_len=SEQ, dtype="bf16",
                                       profile_device=profile_device, top=1, **pins)
        plan = result.plans[0]
        prof = profiled.profile
        if prof.is_timed and args.blocks:
            for b in prof.blocks:
                print(f"    {b.name:<12} {b.kind:<9} fwd {1e3 * b.fwd_time_s:7.3f} ms  bwd {1e3 * b.bwd_time_s:7.3f} ms")
        if prof.is_timed:
            print(f"  timed profile, batch {prof.batch_size}: sum of block fwd "
                  f"{1e3 * sum(b.fwd_time_s for b in prof.blocks):.1f} ms, bwd {1e3 * sum(b.bwd_time_s for b in prof.blocks):.1f} ms",
                  flush=True)
        measured = _train(plan, args.steps)
        row = {"variant": label, "model": RUN_MODEL, "micro_batch_size": plan.micro_batch_size,
               "num_microbatches": plan.num_microbatches, "recompute": plan.recompute,
               "predicted_step_s": plan.predicted.step_time_s,
               "predicted_peak_memory_bytes": plan.predicted.peak_memory_bytes, **measured}
        runs.append(row)
        print(f"{label:<26} mb {plan.micro_batch_size} x {plan.num_microbatches} {plan.recompute:<9} "
              f"step predicted {row['predicted_step_s']:.3f} s measured {row['measured_step_s']:.3f} s "
              f"(pred/meas {row['predicted_step_s'] / row['measured_step_s']:.2f}); peak memory predicted "
              f"{row['predicted_peak_memory_bytes'] / 2**30:.1f} GiB measured {row['peak_memory_bytes'] / 2**30:.1f} GiB; "
              f"loss {measured['losses'][0]:.3f} -> {measured['losses'][-1]:.3f}; optimizer step measured "
              f"{measured['measured_optimizer_s']:.3f} s", flush=True)
        plans.append(plan)
        print("  predicted step, s: " + ", ".join(f"{k} {v:.3f}" for k, v in plan.predicted.breakdown.items())
              + f"; per micro-batch fwd {1e3 * plan.stages[0].fwd_time_s:.1f} ms, bwd {1e3 * plan.stages[0].bwd_time_s:.1f} ms",
              flush=True)
        memory = plan.stages[0].memory
        print("  predicted memory, GiB: " + ", ".join(
            f"{k} {getattr(memory, k + '_bytes') / 2**30:.1f}"
            for k in ("weights", "grads", "optimizer", "activations", "buffers", "allowance")), flush=True)
    out["runs"] = runs
    if dist.is_initialized():
        dist.destroy_process_group()

    with tempfile.TemporaryDirectory() as tmp:  # the CLI launcher on NCCL, one rank
        path = f"{tmp}/plan.json"
        plans[0].save(path)
        cmd = [sys.executable, "-m", "autoplan", "run", path, "--nproc", "1", "--steps", "4",
               "--metrics", f"{tmp}/m.jsonl"]
        print("$ autoplan run plan.json --nproc 1 --steps 4", flush=True)
        code = subprocess.call(cmd)
        out["cli_exit_code"] = code
        if code == 0:
            with open(f"{tmp}/m.jsonl") as f:
                out["cli_metrics"] = [json.loads(line) for line in f]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    del autoplan
    return 0 if out["cli_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
