"""The predicted timeline: the plan's schedule re-simulated with the plan's own stage times
(`StagePlan.fwd_time_s`, `bwd_time_s`), the way `search/assemble.py` does when it makes the plan:
zb-h1 splits the backward into an input-gradient half B and a weight-gradient half W (Qi et al.
2024, Sec. 2: T_B ~ T_W), P2P transfers delay the consumer without occupying either rank, and the
exposed DP reduction plus the optimizer step run after each rank's last action.

Apart from the measured timeline (report/timeline/measured.py): this one reads only the plan.
"""

from __future__ import annotations

from autoplan.plan import BreakdownTerm as Term
from autoplan.plan import Plan
from autoplan.report.timeline.model import Box, Timeline
from autoplan.schedule import Action, ActionKind, make_schedule, simulate

__all__ = ["predicted_timeline"]

def _boundary_bytes(plan: Plan) -> float | None:
    """Bytes of one micro-batch's hidden state crossing a pipeline cut, for zoo models.

    The cut tensor of a transformer is the residual stream, mbs x seq x hidden in the compute
    dtype (Narayanan et al. SC'21 Sec. 3.1); None when the plan's model is not a zoo spec.
    """
    try:
        from autoplan import models as zoo

        info = zoo.model_info(zoo.parse_model_spec(plan.model))
    except Exception:  # a file model or an nn.Module class name: no shape facts to use
        return None
    hidden = info.get("hidden_size")
    if not hidden:
        return None
    dtype_bytes = 4 if plan.job.dtype in ("float32", "fp32") else 2
    return float(plan.micro_batch_size * plan.job.seq_len * hidden * dtype_bytes)


def predicted_timeline(plan: Plan, *, comm: bool = True) -> Timeline:
    """Simulate the plan's schedule with its stage times; one row per pipeline rank.

    With `comm`, zoo models get P2P transfer times from the cluster's links (the boundary tensor
    split over the TP ranks, as `cost/time.py` does); other models draw transfers as free.
    """
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    fwd = [s.fwd_time_s for s in plan.stages]
    bwd = [s.bwd_time_s for s in plan.stages]
    durations: dict[ActionKind, list[float]] = {ActionKind.F: fwd, ActionKind.B: bwd}
    if schedule.split_backward():
        # The plan stores the whole backward; halve it into B and W as evaluate.py does.
        durations[ActionKind.B] = [b / 2 for b in bwd]
        durations[ActionKind.W] = [b / 2 for b in bwd]

    comm_s: dict[tuple[int, int], float] = {}
    num_bytes = _boundary_bytes(plan) if comm and plan.pp > 1 else None
    cluster = plan.cluster_obj() if num_bytes is not None else None

    def comm_time(src: int, dst: int, kind: ActionKind) -> float:
        from autoplan.cluster.collectives import p2p_time_s

        key = (src, dst)
        if key not in comm_s:
            comm_s[key] = p2p_time_s(cluster, plan.rank(src % plan.pp, 0), plan.rank(dst % plan.pp, 0),
                                     num_bytes / plan.tp)
        return comm_s[key]

    breakdown = plan.predicted.breakdown or {}
    dp_s = float(breakdown.get(Term.DP_COMM_EXPOSED, 0.0))
    opt_s = float(breakdown.get(Term.OPTIMIZER, 0.0))
    # A tied head's gradient is summed with its embedding's: the first block is on the first rank and
    # the last block on the last rank (the plan keeps the slowest such sum; cost/time.py).
    tied_s = float(breakdown.get(Term.TIED_GRAD_SYNC, 0.0))
    tied = [tied_s if rank in (0, plan.pp - 1) else 0.0 for rank in range(plan.pp)]
    sim = simulate(schedule, lambda a: durations[a.kind][a.stage], comm_time if num_bytes is not None else None,
                   [tied[rank] + dp_s + opt_s for rank in range(plan.pp)])

    compute_end: dict[tuple[ActionKind, int, int], float] = {}
    boxes_by_rank: list[list[Box]] = [[] for _ in range(plan.pp)]
    for t in sim.timeline:
        compute_end[(t.action.kind, t.action.stage, t.action.microbatch)] = t.end_s
        boxes_by_rank[t.rank].append(Box(t.rank, str(t.action), t.action.kind.value, t.start_s, t.end_s))
    if num_bytes is not None:
        # A transfer starts when its producer ends and lands on the consumer's rank.
        last = plan.num_stages - 1
        for (kind, stage, mb), end in compute_end.items():
            if kind is ActionKind.F and stage < last:
                dst, recv = stage + 1, ActionKind.RECV_F
            elif kind is ActionKind.B and stage > 0:
                dst, recv = stage - 1, ActionKind.RECV_B
            else:
                continue
            if dst % plan.pp == stage % plan.pp:
                continue
            rank = dst % plan.pp
            boxes_by_rank[rank].append(Box(rank, str(Action(recv, dst, mb)), recv.value, end,
                                           end + comm_time(stage, dst, kind)))
    for rank, end in enumerate(sim.compute_end_s):
        if tied[rank] > 0:
            boxes_by_rank[rank].append(Box(rank, "TIED", "TIED", end, end + tied[rank]))
            end += tied[rank]
        if dp_s > 0:
            boxes_by_rank[rank].append(Box(rank, "DP", "DP", end, end + dp_s))
        if opt_s > 0:
            boxes_by_rank[rank].append(Box(rank, "OPT", "OPT", end + dp_s, end + dp_s + opt_s))
    boxes = tuple(b for rank_boxes in boxes_by_rank for b in sorted(rank_boxes, key=lambda b: (b.start_s, not b.is_compute)))
    return Timeline("predicted", plan.pp, boxes, sim.makespan_s, sim.bubble_fraction)
