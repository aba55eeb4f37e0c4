"""autoplan's pipeline executor vs torch.distributed.pipelining, side by side.

Same model, same cut points, same stage modules, same schedule (gpipe and 1f1b), 4 gloo ranks on
CPU. Steps alternate autoplan / torch (paired runs) after warm-up; each step is bracketed by
barriers and its time is the slowest rank's. Prints the median step times and their ratio per
schedule; `--json PATH` writes them.

    python benchmarks/executor_vs_torch.py --steps 10 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _plan(spec: str, schedule: str, pp: int, micro_batch_size: int, num_microbatches: int, seq_len: int):
    from _dist import make_plan

    from autoplan import models as zoo
    from autoplan.graph.profile import model_fingerprint
    from autoplan.graph.trace import trace_model

    model = zoo.build_model(spec, device="meta")
    traced = trace_model(model, zoo.example_inputs(spec, 1, seq_len))
    return make_plan(spec, model_fingerprint(model), traced.block_names, pp=pp, schedule=schedule,
                     micro_batch_size=micro_batch_size, num_microbatches=num_microbatches, seq_len=seq_len)


def _torch_schedule(spec: str, plan, rank: int):
    """torch PipelineStage + ScheduleGPipe/Schedule1F1B over the same stage module autoplan builds."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from autoplan import models as zoo
    from autoplan.graph.trace import trace_model
    from autoplan.runtime.parallel.split import (
        build_stage_modules,
        materialize_stages,
        plan_stage_specs,
        propagate_values,
        tied_parameter_names,
    )

    model = zoo.build_model(spec, device="meta")
    traced = trace_model(model, zoo.example_inputs(spec, plan.micro_batch_size, plan.job.seq_len))
    values = propagate_values(traced, {"input_ids": torch.empty(plan.micro_batch_size, plan.job.seq_len,
                                                                dtype=torch.int64, device="meta")})
    specs = plan_stage_specs(traced, plan.boundaries, values)
    module = build_stage_modules(traced, specs)[rank]
    materialize_stages([module], torch.device("cpu"), aliases=tied_parameter_names(model))
    stage = PipelineStage(module, rank, plan.pp, torch.device("cpu"))
    cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return cls(stage, plan.num_microbatches, loss_fn=_torch_loss), module


def _torch_loss(output, target):
    from autoplan import models as zoo

    return zoo.lm_loss(output[0] if isinstance(output, tuple) else output, target)  # stage modules return tuples


def _worker(rank: int, world_size: int, port: int, args: dict, queue) -> None:
    from datetime import timedelta

    from autoplan import models as zoo
    from autoplan.runtime import partition

    torch.set_num_threads(args["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    results = {}
    for schedule in args["schedules"]:
        plan = _plan(args["spec"], schedule, world_size, args["micro_batch_size"], args["num_microbatches"], args["seq_len"])
        batch = plan.micro_batch_size * plan.num_microbatches
        ids = zoo.example_inputs(args["spec"], batch, plan.job.seq_len, device="cpu")[0]
        tgt = zoo.example_targets(args["spec"], batch, plan.job.seq_len, device="cpu")
        pm = partition(args["spec"], plan, device="cpu", timeout=timedelta(seconds=300))
        torch_sched, torch_module = _torch_schedule(args["spec"], plan, rank)

        def run_autoplan(pm=pm, ids=ids, tgt=tgt):
            pm.step(ids, target=tgt)

        def run_torch(torch_sched=torch_sched, torch_module=torch_module, ids=ids, tgt=tgt):
            torch_module.zero_grad(set_to_none=True)
            if rank == 0:
                torch_sched.step(ids)
            elif rank == world_size - 1:
                torch_sched.step(target=tgt, losses=[])
            else:
                torch_sched.step()

        times = {"autoplan": [], "torch": []}
        for i in range(args["warmup"] + args["steps"]):
            for name, fn in (("autoplan", run_autoplan), ("torch", run_torch)) if i % 2 == 0 else \
                    (("torch", run_torch), ("autoplan", run_autoplan)):
                dist.barrier()
                start = time.perf_counter()
                fn()
                dist.barrier()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= args["warmup"]:
                    times[name].append(float(elapsed))
        results[schedule] = times
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="gpt:num_layers=8,hidden_size=256,num_heads=8,vocab_size=2048,max_seq_len=128")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--json", default=None, help="write the results here")
    a = parser.parse_args(argv)
    args = dict(spec=a.spec, seq_len=a.seq_len, micro_batch_size=a.micro_batch_size, num_microbatches=a.num_microbatches,
                steps=a.steps, warmup=a.warmup, threads=a.threads, schedules=a.schedules.split(","))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(a.ranks, port, args, queue), nprocs=a.ranks, join=True, start_method="spawn")
    results = queue.get()
    rows = []
    print(f"{a.spec}, seq {a.seq_len}, micro-batch {a.micro_batch_size} x {a.num_microbatches}, {a.ranks} gloo ranks, "
          f"{a.steps} paired steps after {a.warmup} warm-up")
    print(f"{'schedule':<10} {'autoplan s':>11} {'torch s':>9} {'ratio':>7}")
    for schedule, times in results.items():
        ours, theirs = statistics.median(times["autoplan"]), statistics.median(times["torch"])
        rows.append({"schedule": schedule, "autoplan_median_s": ours, "torch_median_s": theirs,
                     "ratio_autoplan_over_torch": ours / theirs, "autoplan_s": times["autoplan"], "torch_s": times["torch"]})
        print(f"{schedule:<10} {ours:>11.4f} {theirs:>9.4f} {ours / theirs:>7.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {**args, "ranks": a.ranks}, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
