"""ZeRO 0 / 1 / 2 / 3 and HSDP on 4 gloo ranks: step time and memory measured beside predicted.

    python benchmarks/zero_levels_cpu.py [--steps 6] [--json benchmarks/results/zero_levels_cpu.json]

One model, one cluster (`1x4xcpu`), every dimension pinned but the data-parallel sharding: dp 4
(and pp 2 x dp 2 for zero 3), profiled on this CPU (`profile_device="cpu"`, one thread per rank as
each of the 4 ranks gets on this machine). Each plan runs through `autoplan.partition(...).step` on 4
spawned gloo ranks; per rank it reports:

- state: bytes of parameters, gradients and optimizer state held after a step
  (`calibrate/measure.py held_state_bytes`), beside the plan's weights + gradients + optimizer bytes
  for that rank (cost/memory.py). Ratio predicted / measured; 1.00 means the model counts what the
  runtime holds.
- peak: the state held before the step plus the most bytes the step's forward and backward ops have
  alive at once (`LiveBytes`, a dispatch mode: activations, FSDP's gathered parameters and unsharded
  gradients, communication buffers), beside the plan's peak less the allowance for a CUDA context
  and fragmentation (`allowance_bytes`, which a CPU does not have). >= 1 means not under-predicted.
  The optimizer step's own temporaries (torch's foreach AdamW) are reported apart ("opt peak"): the
  model does not count them; they come after the activations are freed.
- step: the median step time after 2 warm-up steps, beside the predicted step time. On a 2-core
  machine 4 ranks share 2 cores, so absolute times are the machine's; the ratios between zero
  levels are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch

MODEL = "gpt:num_layers=4,hidden_size=256,num_heads=4,vocab_size=4096,max_seq_len=128"
CASES = [  # (name, pins)
    ("zero0", dict(pp=1, dp=4, zero=0)),
    ("zero1", dict(pp=1, dp=4, zero=1)),
    ("zero2", dict(pp=1, dp=4, zero=2)),
    ("zero3", dict(pp=1, dp=4, zero=3)),
    ("hsdp2x2", dict(pp=1, dp=4, zero=3, dp_replicate=2)),
    ("pp2-zero3", dict(pp=2, dp=2, zero=3)),
]


def _plan(model: str, pins: dict, dtype: str):
    from autoplan.api import suggest_with_stats

    result, _ = suggest_with_stats(model, "1x4xcpu", global_batch=16, seq_len=128, dtype=dtype,
                                   profile_device="cpu", tp=1, micro_batch_size=2, schedule="1f1b",
                                   recompute="none", **pins)
    return result.plans[0]


def _rank(rank: int, world: int, port: int, plan_json: str, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from autoplan.calibrate.measure import LiveBytes, held_state_bytes
    from autoplan.plan import Plan
    from autoplan.runtime import partition

    plan = Plan.from_dict(json.loads(plan_json))
    pm = partition(plan.model, plan, device="cpu")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-4)
    template = pm.output_template
    times = []
    for step in range(steps):
        inputs, target = pm.source.batch(0, step, plan.job.global_batch, plan.job.seq_len, template.shape,
                                         template.dtype)
        dist.barrier()
        start = time.perf_counter()
        pm.step(*inputs, target=target)
        optimizer.step()
        times.append(time.perf_counter() - start)
    # Peak of the next step: what is held going in (gradients are dropped at its start) plus what
    # its ops allocate.
    pm.zero_grad()
    before = held_state_bytes(pm, optimizer)
    inputs, target = pm.source.batch(0, steps, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    tracker = LiveBytes()
    with tracker:
        pm.step(*inputs, target=target)
    step_peak = tracker.peak
    with tracker:  # the optimizer's own temporaries (foreach kernels), after the activations are gone
        optimizer.step()
    after = held_state_bytes(pm, optimizer)
    queue.put((rank, {"times": times, "state": after, "peak": sum(before.values()) + step_peak,
                      "optimizer_peak": sum(before.values()) + tracker.peak, "pp_index": pm.layout.pp_index}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(plan, steps: int) -> dict[int, dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 4, port, plan.to_json(), steps, queue)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--dtype", default="fp32", help="fp32 (default: what a CPU computes natively) or bf16")
    parser.add_argument("--json")
    args = parser.parse_args()
    from autoplan.cost.memory import allowance_bytes

    mib = 2**20
    rows = []
    print(f"{args.model}, {args.dtype}, 4 gloo ranks on {os.cpu_count()} cores ({platform.machine()}); "
          "MiB and ms, rank 0 (pp rank 0); ratio = predicted / measured")
    print(f"{'plan':<10} {'state meas':>10} {'pred':>8} {'ratio':>5}  {'peak meas':>9} {'pred':>8} {'ratio':>5}  "
          f"{'step meas':>9} {'pred':>8} {'ratio':>5}  {'opt peak':>8}")
    for name, pins in CASES:
        plan = _plan(args.model, pins, args.dtype)
        results = measure(plan, args.steps)
        gpu = plan.cluster_obj().gpu_types[0]
        for rank in sorted(results):
            res = results[rank]
            memory = next(s.memory for s in plan.stages if s.pp_rank == res["pp_index"])
            predicted_state = memory.weights_bytes + memory.grads_bytes + memory.optimizer_bytes
            predicted_peak = memory.total_bytes - allowance_bytes(gpu)
            step = statistics.median(res["times"][2:])
            row_opt = res["optimizer_peak"]
            row = {"plan": name, "rank": rank, "pins": pins, "measured_state": res["state"],
                   "predicted_state": predicted_state, "measured_peak": res["peak"],
                   "predicted_peak": predicted_peak, "measured_optimizer_peak": row_opt, "measured_step_s": step,
                   "predicted_step_s": plan.predicted.step_time_s,
                   "state_ratio": predicted_state / sum(res["state"].values()),
                   "peak_ratio": predicted_peak / res["peak"], "step_ratio": plan.predicted.step_time_s / step}
            rows.append(row)
            if rank == 0:
                print(f"{name:<10} {sum(res['state'].values()) / mib:>10.1f} {predicted_state / mib:>8.1f} "
                      f"{row['state_ratio']:>5.2f}  {res['peak'] / mib:>9.1f} {predicted_peak / mib:>8.1f} "
                      f"{row['peak_ratio']:>5.2f}  {1e3 * step:>9.0f} {1e3 * plan.predicted.step_time_s:>8.0f} "
                      f"{row['step_ratio']:>5.2f}  {row_opt / mib:>8.1f}", flush=True)
    print(f"over all ranks: state ratio {min(r['state_ratio'] for r in rows):.3f}..{max(r['state_ratio'] for r in rows):.3f}, "
          f"lowest peak ratio {min(r['peak_ratio'] for r in rows):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "torch": torch.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
