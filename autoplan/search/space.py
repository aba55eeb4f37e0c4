"""The search space: enumerate parallel configurations, prune them, and rank the survivors.

[Note: search order and pruning]
Outer loop: tp x pp x dp = N (tp inside a node, and a degree the model's tensor-parallel layout
allows: graph/sharding.py, recorded by the profile), micro-batch
size, schedule and virtual stages, rank order. For each such *base* configuration the memory-saving
options are tried as a ladder, from fastest to most frugal: recompute none -> selective -> full,
and within each, ZeRO and sequence parallelism (which cost no time in this model: ZeRO-1's
reduce-scatter + all-gather moves what an all-reduce moves, and sequence parallelism's
reduce-scatter + all-gather replaces TP's all-reduce, Korthikanti et al. 2022 Sec. 4.2.2). The
first rung that fits is the base configuration's plan: later rungs are never faster.

Two bounds prune before any cutting (docs/architecture.md, "The search"):
- memory: weights + gradients + optimizer states spread perfectly over pp stages and tp ranks
  must fit a GPU, otherwise no cutting can fit;
- time: a base configuration cannot beat m * (sum of block times) / pp (perfect balance, no
  bubble, no communication). Configurations are evaluated in increasing order of an estimate
  (the bound with the schedule's bubble), and each is skipped once its bound reaches the K-th best
  step time found ([Note: an exact top k]).

[Note: an exact top k]
The top k is the true order of what the search evaluates: every pruning is by a valid lower bound
against the k-th plan kept (a bound that is not one cut plans a pinned search then found, issue
29), ties rank by `_plan_key` (not by the order of evaluation, which depends on k), and the list is
kept sorted, so top k is a prefix of top k + n. The bounds: `pre_cut_bound` of the fastest rung
(sequence parallelism as the rungs have it); before the DP's tie-break, m times the bottleneck
less two boundaries' P2P (bounds.py `bottleneck_bound`: every cutting with that bottleneck);
after it, the simulated cutting's own `step_lower_bound` and `simulated_step_lower_bound`. The
ladder keeps one rung per configuration and sharding option (later rungs and FSDP where ZeRO-1
fits are taken as no faster), so a pinned search can return another rung of a listed
configuration, never a configuration the list misses. tests/test_topk_exact.py pins each
dimension of each top plan of a few cases to check this.

GPipe is only evaluated when pinned: its bubble equals 1F1B's and it holds all m micro-batches'
activations (Narayanan et al. 2021, Sec. 2.2.1), so 1F1B dominates it in this model.

[Note: sharded data parallelism in the search]
Each base configuration with dp > 1 also tries FSDP (zero 2 and 3, cost/memory.py [Note: bytes
per parameter], cost/comm.py [Note: FSDP communication]), each over all dp ranks and, as HSDP, over
shard groups of gpus_per_node / tp ranks (a node's worth of data-parallel ranks: its all-gathers
stay on NVLink; Zhao et al. 2023, Sec. 3.2.2) when that divides dp: at most four options
(`shardings`). FSDP moves what ZeRO-1's all-reduce moves plus the parameter all-gathers, so at one
recompute level it is never faster than ZeRO-1: an FSDP option only descends the recompute ladder
down to (not including) the rung where ZeRO-1 fits or is dominated. Zero 3 gathers more often than
zero 2 and holds less, so zero 3 only tries the rungs where zero 2 (same replicate degree) did not
fit. zb-h1 never runs with FSDP (its weight-gradient pass bypasses FSDP's gradient hooks; the
runtime refuses it). The plan's note compares the best plan with the best plan of the other kind
(`_sharding_note`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from autoplan.cluster import Cluster
from autoplan.cost.calibration import Calibrations
from autoplan.cost.config import ParallelConfig
from autoplan.cost.experts import expert_links
from autoplan.cost.memory import allowance_bytes, block_static_bytes
from autoplan.graph.blocks import ModelProfile
from autoplan.layout import layout_key_getter
from autoplan.plan import RECOMPUTE, Job, Plan, expert_layout_refusal
from autoplan.plan import BreakdownTerm as Term
from autoplan.schedule import schedule_spec
from autoplan.search._gc import gc_paused
from autoplan.search.bounds import Dominated
from autoplan.search.configs import (
    DEFAULT_MBS,
    MAX_MICROBATCHES,
    NoPlanError,
    PlanningError,
    base_configs,
    check_pins,
    config_pins,
    fmt_gib,
    frugal_config,
    fsdp_refusal,
    memory_fix,
    sequence_parallel_allowed,
    shardings,
    tp_degrees_possible,
    tp_refusal,
    with_memory_options,
)
from autoplan.search.context import MEMO_KEY_INSTEAD, MEMO_LEAVES_OUT, SearchContext
from autoplan.search.evaluate import evaluate, min_memory_bytes
from autoplan.search.rejections import Rejection, Rejections
from autoplan.search.targets import ExportRules, TargetFilter

__all__ = ["NoPlanError", "PlanningError", "SearchResult", "search_plans"]

CONFIG_KEY_LEAVES_OUT = ("rank_order",)
"""Layout fields a configuration's key leaves out (`_config_key`, `_same_but_layout`): rejections
keep, and the top plans hold, one configuration per rank order's worth of the others."""
_STATIC_LEAVES_OUT = ("cp", "virtual_stages", "rank_order")
"""Layout fields the weights-alone bound's memo leaves out (search/context.py `MEMO_LEAVES_OUT`)."""

# The key getters of the loop's memos, made once (autoplan/layout.py `layout_key_getter`): the bound
# below builds a key for every configuration considered.
_STATIC_KEY = layout_key_getter(_STATIC_LEAVES_OUT, ("pp",))
_TIMES_KEY = layout_key_getter(MEMO_LEAVES_OUT["times"], MEMO_KEY_INSTEAD["times"])
_CONFIG_KEY = layout_key_getter(CONFIG_KEY_LEAVES_OUT)

@dataclass
class SearchResult:
    plans: list[Plan]
    configs_evaluated: int
    """Configurations cut and simulated: each base configuration's memory variants (recompute x
    ZeRO / FSDP) count one each, so this can exceed `configs_considered`."""
    configs_considered: int
    """Base configurations enumerated (tp x pp x dp x cp x ep x micro-batch x schedule x rank order)."""
    time_s: float
    notes: list[str] = field(default_factory=list)
    rejections: Rejections = field(default_factory=Rejections)
    """Base configurations dropped, per reason ([Note: recording rejections] in search/rejections.py);
    with `explain`, the best few of each with figures."""
    configs_planned: int = 0
    """Base configurations that gave a plan (at least `len(plans)`: the top k keeps the fastest, one
    per configuration without its rank layout). Counted, not derived from the rejections: those also
    count splits `base_configs` refused before enumerating them (issue 43: "0 gave a plan" printed
    above the plan it wrote)."""

    def kept_rejections(self) -> list[Rejection]:
        """The kept rejections, reason by reason (empty unless the search ran with `explain`)."""
        return [r for reason in self.rejections.counts for r, _ in self.rejections.kept(reason)]  # REASONS, "target"

    def to_dict(self) -> dict:
        search = {"time_s": self.time_s, "configs_evaluated": self.configs_evaluated,
                  "configs_considered": self.configs_considered, "configs_planned": self.configs_planned,
                  "rejected": dict(self.rejections.counts),
                  "notes": list(self.notes)}
        if self.rejections.detailed:
            search["rejections"] = [r.to_dict() for r in self.kept_rejections()]
        return {"plans": [p.to_dict() for p in self.plans], "search": search}


def search_plans(profile: ModelProfile, cluster: Cluster, job: Job, *, model_spec: str, top: int = 5,
                 pins: dict | None = None, progress: Callable[[int, int, str], None] | None = None,
                 calibrations: Calibrations | None = None, explain: bool = False,
                 advise: bool = True, target: ExportRules | None = None) -> SearchResult:
    """The `top` fastest plans that fit, ranked by simulated step time. `calibrations` gives each GPU
    type's achieved rates (default: the files shipped for each type, cost/calibration.py).
    `explain`: keep the best few rejected configurations per reason, with figures and a fix checked
    to fit ([Note: recording rejections]). `advise`: when nothing fits, say by how much and what
    would fit, checked by further searches (search/advice.py). `target`: only plans that trainer
    runs as planned, asked of its exporter's rules (`report.export.export_rules(name)`, search/targets.py)."""
    started = time.perf_counter()
    with gc_paused():  # see search/_gc.py: the search allocates much and creates no cycles
        return _search_plans(profile, cluster, job, model_spec=model_spec, top=top, pins=pins, progress=progress,
                             started=started, calibrations=calibrations, explain=explain, advise=advise,
                             target=target)


def _search_plans(profile: ModelProfile, cluster: Cluster, job: Job, *, model_spec: str, top: int,
                  pins: dict | None, progress: Callable[[int, int, str], None] | None, started: float,
                  calibrations: Calibrations | None = None, explain: bool = False,
                  advise: bool = True, target: ExportRules | None = None) -> SearchResult:
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    check_pins(profile, cluster, job, pins)
    if top < 1:
        raise PlanningError(f"--top {top} must be at least 1")
    if profile.flops <= 0 and not profile.is_timed:
        raise PlanningError(f"{profile.model_name} has no FLOPs to place (no matmuls were traced); there is nothing "
                            "to plan")
    ctx = SearchContext(profile, cluster, job, model_spec, calibrations)
    sp_allowed = sequence_parallel_allowed(profile)
    notes = []
    # Only degrees the GPU count and the pins leave a split for: the others were never possible.
    refused = [t for t in tp_degrees_possible(profile, cluster, pins) if tp_refusal(profile, t) is not None]
    if "tp" not in pins and refused:
        why = tp_refusal(profile, refused[0])
        notes.append(f"tp {', '.join(map(str, refused))} not considered: "
                     + (f"tp {refused[0]} {why}" if why.startswith("does not") else why))
    all_pinned = all(k in pins for k in ("tp", "pp", "dp", "micro_batch_size", "schedule", "recompute", "zero"))
    if all_pinned:
        pins.setdefault("dp_replicate", 1)  # one plan: plain FSDP unless HSDP is asked for
        pins.setdefault("cp", 1)  # and whole sequences, every expert on every rank, unless asked for
        pins.setdefault("ep", 1)

    # Bound every base configuration (cheap), then evaluate in increasing order of the bound.
    candidates: list[tuple[float, float, int, ParallelConfig, ParallelConfig]] = []  # (estimate, bound, i, base, fastest rung)
    considered = 0
    min_capacity = min(g.mem_bytes - allowance_bytes(g) for g in cluster.gpu_types)
    static_cache: dict[tuple[int, int], float] = {}
    recomputes = [pins["recompute"]] if pins.get("recompute") else list(RECOMPUTE)
    time_cache: dict[tuple, float] = {}
    fwd_share_cache: dict[tuple, float] = {}
    rejections = Rejections(detailed=explain)
    only = TargetFilter.make(target, profile, job, model_spec, pins, rejections)  # --target (search/targets.py)
    for cfg in base_configs(profile, cluster, job, pins, rejections):
        considered += 1
        if only is not None and only.drops_base(cfg, considered, lambda n=considered: SearchResult(
                [], 0, n, time.perf_counter() - started, notes, rejections)):
            continue
        if not shardings(cfg, pins, cluster.gpus_per_node, profile):
            if explain:
                rejections.add("layout", considered, _config_key(cfg), functools.partial(
                    Rejection, "layout", cfg.describe(), _sharding_refusal(cfg, pins, profile)))
            else:
                rejections.counts["layout"] += 1
            continue
        frugal = frugal_config(cfg, pins, sp_allowed, cluster.gpus_per_node, profile)
        key = (frugal.zero, cfg.reduce_dtype, *_STATIC_KEY(frugal), cfg.pp == 1)
        if key not in static_cache:
            static_cache[key] = float(block_static_bytes(profile, frugal, job.dtype).sum())
        weights_over = static_cache[key] / cfg.pp > min_capacity and not all_pinned
        if weights_over and not explain:
            rejections.counts["memory"] += 1
            continue  # not even the weights fit, whatever the cuts
        # The bound holds for every rung: it prices the fastest one (the least recompute the ladder
        # tries, sequence parallelism as every rung has it, which changes the block times), on the
        # fastest GPU type for each block, with the links evaluate() uses (the search context's
        # cluster). Pricing the base configuration instead (no sequence parallelism) made the bound
        # exceed real step times and cut plans from the top k that a pinned search then found.
        fastest = with_memory_options(cfg, pins, sp_allowed, recomputes[0], frugal.zero, frugal.dp_replicate)
        spread = cfg.ep > 1 or cfg.cp > 1  # their groups' links depend on the rank layout (as SearchContext.block_times)
        tkey = (cfg.micro_batch_size, fastest.sequence_parallel, *_TIMES_KEY(cfg), cfg.rank_order if spread else None,
                cfg.pp if spread else None)
        if tkey not in time_cache:
            time_cache[tkey] = float(np.min([ctx.block_times(g, fastest).total_s for g in ctx.cluster.gpu_types],
                                            axis=0).sum())
        if tkey not in fwd_share_cache:
            fwd_share_cache[tkey] = _fwd_share(ctx, fastest)
        bound = pre_cut_bound(cfg, time_cache[tkey], fwd_share_cache[tkey])
        if weights_over:  # (explain) kept in the order of its bound, as the configurations evaluated
            smallest = min(cluster.gpu_types, key=lambda g: g.mem_bytes)
            need = static_cache[key] / cfg.pp + allowance_bytes(smallest)
            rejections.add("memory", bound, _config_key(frugal), functools.partial(
                _memory_rejection, frugal, bound, need, smallest.mem_bytes,
                "its weights, gradients and optimizer states alone"), frugal)
            continue
        # Order by an estimate with the schedule's bubble (equal stages: (p-1)/v of the ideal time
        # for 1F1B/interleaved, about a third of that for zero-bubble H1, Qi et al. 2024 Table 2)
        # so good plans come first and the valid bound prunes early.
        ramp = (cfg.pp - 1) / cfg.virtual_stages / (3 if schedule_spec(cfg.schedule).split_backward else 1)
        estimate = bound * (cfg.num_microbatches + ramp) / cfg.num_microbatches
        candidates.append((estimate, bound, len(candidates), cfg, fastest))
    def so_far() -> SearchResult:
        """What the search did until it found nothing (NoPlanError.result); with `explain` the
        over-memory rejections kept get their figures and fixes first."""
        if explain:
            explain_memory(ctx, rejections, pins, sp_allowed)
        return SearchResult([], evaluated, considered, time.perf_counter() - started, notes, rejections, planned)

    evaluated = planned = 0
    if considered == 0 and not pins:
        raise NoPlanError(f"no tp x pp x dp split of {cluster.num_gpus} GPUs (tp <= {cluster.gpus_per_node} per node, "
                          f"pp <= {profile.num_blocks} blocks) has a data-parallel degree dividing the global batch "
                          f"{job.global_batch}; use a global batch that is a multiple of the data-parallel degree, "
                          "or fewer GPUs", so_far())
    if not candidates and only is not None and only.no_plan_message():
        raise NoPlanError(only.no_plan_message(), so_far())
    if not candidates:
        per_replica_min = job.global_batch * cluster.gpus_per_node // cluster.num_gpus
        if per_replica_min > MAX_MICROBATCHES * max(DEFAULT_MBS):
            raise NoPlanError(f"global batch {job.global_batch} needs more than {MAX_MICROBATCHES} micro-batches "
                              "per replica on this cluster; use a smaller batch or more GPUs", so_far())
        _raise_no_plan(ctx, cluster, pins, sp_allowed, advise, so_far())
    candidates.sort()

    best: list[tuple[float, tuple, Plan]] = []  # the top plans, fastest first ([Note: an exact top k])
    best_by_kind: dict[bool, Plan] = {}  # FSDP (zero >= 2) or not -> the fastest plan that fits
    best_by_ep: dict[bool, Plan] = {}  # expert parallelism (ep > 1) or not -> the fastest plan that fits
    best_by_cp: dict[bool, Plan] = {}  # context parallelism (cp > 1) or not -> the fastest plan that fits

    def ladder(cfg: ParallelConfig, options: list[tuple[int, int]], stop: dict[tuple[int, int], int]) -> str | None:
        """Descend the recompute ladder of each sharding option until a rung fits or is dominated;
        `stop` records that rung per option ([Note: sharded data parallelism in the search]). Returns
        None when a plan was offered, else why none was: "bound", "memory" or "layout" (with the
        lowest bound that pruned it in `pruned`)."""
        nonlocal evaluated
        offered, outcome = False, None
        pruned.clear()
        no_fit: set[tuple[int, int]] = set()  # (zero, rung) where FSDP over all of dp did not fit or was dominated
        for option in options:
            zero, replicate = option
            limit = len(recomputes)
            if zero >= 2:
                limit = min([limit] + [stop[o] for o in stop if o[0] < 2 or (zero == 3 and o == (2, replicate))])
            stop[option] = limit
            previous_acts = None
            for rung, recompute in enumerate(recomputes[:limit]):
                variant = with_memory_options(cfg, pins, sp_allowed, recompute, zero, replicate)
                if only is not None and (variant := only.adjust(variant)) is None:
                    continue  # a rung the target does not run
                acts = ctx.act_bytes(variant)
                if previous_acts is not None and np.array_equal(acts, previous_acts):
                    continue  # same memory as the rung that did not fit, and slower
                previous_acts = acts
                if replicate > 1 and (zero, rung) in no_fit:
                    continue  # HSDP holds more than FSDP over all of dp, which did not fit (or could not win)
                cutoff = best[-1][0] if len(best) >= top else float("inf")
                floor = fsdp_floor_s(ctx, variant) if zero >= 2 else 0.0
                if floor >= cutoff:
                    stop[option] = rung
                    if replicate == 1:
                        no_fit.add((zero, rung))
                    outcome = "bound"
                    pruned.append((floor, cutoff, variant))
                    break  # its communication alone cannot beat the top plans; more recompute is slower
                evaluated += 1
                ctx.refusal = None
                try:
                    result = evaluate(ctx, variant, require_fit=not all_pinned, cutoff_s=cutoff)
                except Dominated as exc:
                    stop[option] = rung
                    if zero >= 2 and replicate == 1:
                        no_fit.add((zero, rung))  # HSDP has the same compute and fewer cuttings that fit
                    outcome = "bound"
                    pruned.append((exc.args[0] if exc.args else cutoff, cutoff, variant))
                    break  # later rungs of the ladder are no faster
                if result is None:
                    if zero >= 2 and replicate == 1:
                        no_fit.add((zero, rung))
                    if ctx.refusal is not None:
                        refused.append((ctx.refusal, variant))
                        outcome = outcome or "layout"
                    elif outcome != "bound":
                        outcome = "memory"
                    continue
                if only is not None and (result.plan.fits or all_pinned) and (
                        result := only.accept(ctx, result)) is None:
                    continue  # its cuts are not the target's, nor do the target's own cuts fit
                if result.plan.fits or all_pinned:
                    stop[option] = rung
                    offered = True
                    _keep(best, top, result.step_time_s, result.plan)
                    kind = zero >= 2
                    if result.plan.fits and (kind not in best_by_kind or result.step_time_s
                                             < best_by_kind[kind].predicted.step_time_s):
                        best_by_kind[kind] = result.plan
                    expert_kind = result.plan.ep > 1
                    if result.plan.fits and (expert_kind not in best_by_ep or result.step_time_s
                                             < best_by_ep[expert_kind].predicted.step_time_s):
                        best_by_ep[expert_kind] = result.plan
                    context_kind = result.plan.cp > 1
                    if result.plan.fits and (context_kind not in best_by_cp or result.step_time_s
                                             < best_by_cp[context_kind].predicted.step_time_s):
                        best_by_cp[context_kind] = result.plan
                    break
        return None if offered else outcome or "memory"  # rungs skipped: HSDP or the same memory did not fit

    pruned: list[tuple[float, float, ParallelConfig]] = []  # (lower bound, cutoff, variant) of the last ladder
    refused: list[tuple[str, ParallelConfig]] = []
    for index, (_, bound, _, cfg, fastest) in enumerate(candidates):
        if len(best) >= top and bound >= best[-1][0]:
            # Ordered by the estimate, not the bound: later ones may still qualify.
            if explain:
                rejections.add("bound", bound, _config_key(fastest), functools.partial(
                    _bound_rejection, fastest, bound, best[-1][0], top))
            else:
                rejections.counts["bound"] += 1  # the fast path builds nothing ([Note: recording rejections])
            continue
        options = shardings(cfg, pins, cluster.gpus_per_node, profile)
        outcome = ladder(cfg, options, {})
        outcome = only.outcome(outcome, cfg, bound) if only is not None else outcome
        planned += outcome is None
        if outcome is not None and not explain:
            rejections.counts[outcome] += 1
        elif outcome == "target":
            pass  # counted and kept by the filter
        elif outcome == "bound":
            low, cutoff, variant = min(pruned, key=lambda e: e[0])
            rejections.add("bound", low, _config_key(variant), functools.partial(
                _bound_rejection, variant, low, cutoff, top))
        elif outcome == "memory":
            frugal = frugal_config(cfg, pins, sp_allowed, cluster.gpus_per_node, profile)
            rejections.add("memory", bound, _config_key(frugal), functools.partial(
                _memory_rejection, frugal, bound, None, min(g.mem_bytes for g in cluster.gpu_types),
                "no cutting of it"), frugal)
        elif outcome == "layout":
            why, variant = refused[-1]
            rejections.add("layout", bound, _config_key(variant), functools.partial(
                Rejection, "layout", variant.describe(), why, bound))
        refused.clear()
        if progress is not None:
            progress(index + 1, len(candidates), cfg.describe())
    plans = [p for _, _, p in best]
    if not plans and only is not None and only.no_plan_message():
        raise NoPlanError(only.no_plan_message(), so_far())
    if not plans:
        _raise_no_plan(ctx, cluster, pins, sp_allowed, advise, so_far())
    if explain:
        explain_memory(ctx, rejections, pins, sp_allowed)
    considered_cp = plans[0].cp > 1 or True in best_by_cp or pins.get("cp", 1) > 1  # long sequences only
    note = _context_note(ctx, plans[0], best_by_cp, pins) if considered_cp else None
    if note:
        notes.append(note)
        plans[0] = dataclasses.replace(plans[0], notes=(*plans[0].notes, note))
    note = _expert_note(ctx, plans[0], best_by_ep, pins) if profile.extra.get("experts") else None
    if note:
        notes.append(note)
        plans[0] = dataclasses.replace(plans[0], notes=(*plans[0].notes, note))
    note = None if plans[0].ep > 1 else _sharding_note(ctx, plans[0], best_by_kind, pins)
    if note:
        notes.append(note)
        plans[0] = dataclasses.replace(plans[0], notes=(*plans[0].notes, note))
    return SearchResult(plans, evaluated, considered, time.perf_counter() - started, notes, rejections, planned)


def _plan_key(plan: Plan) -> tuple:
    """A total order on plans of equal step time, the same whatever else the search kept: ties
    rank the same way in a top 5 and a top 8."""
    return (plan.tp, plan.pp, plan.dp, plan.micro_batch_size, plan.schedule, plan.virtual_stages,
            RECOMPUTE.index(plan.recompute), plan.zero, plan.dp_replicate, plan.sequence_parallel, plan.ep, plan.cp,
            plan.rank_order, *plan.layout_key())  # the layout last: every field, the ones added later too


def _keep(best: list[tuple[float, tuple, Plan]], top: int, step_time_s: float, plan: Plan) -> None:
    """Offer a plan to the sorted list of the `top` fastest (ties by `_plan_key`)."""
    entry = (step_time_s, _plan_key(plan), plan)
    twin = next((i for i, e in enumerate(best) if _same_but_layout(e[2], plan)), None)
    if twin is not None:
        # Only the rank layout differs: keep the faster one, not both.
        if entry[:2] < best[twin][:2]:
            del best[twin]
        else:
            return
    if len(best) >= top and entry[:2] >= best[-1][:2]:
        return
    bisect.insort(best, entry, key=lambda e: e[:2])
    del best[top:]


def _config_key(cfg: ParallelConfig) -> tuple:
    """A configuration without its rank layout: rejections keep one per key."""
    return (cfg.micro_batch_size, cfg.schedule, cfg.recompute, cfg.zero, *_CONFIG_KEY(cfg))


def _sharding_refusal(cfg: ParallelConfig, pins: dict, profile: ModelProfile) -> str:
    """Why `shardings` offers no data-parallel sharding for this configuration (one line)."""
    if cfg.ep > 1:
        return (expert_layout_refusal(cfg.ep, cfg.tp, cfg.dp, cfg.dp_replicate, cfg.expert_tp)
                or "the runtime runs expert parallelism with zero 0, 2 or 3 and without HSDP")
    if not schedule_spec(cfg.schedule).runs_fsdp:
        return f"{cfg.schedule} cannot run FSDP (its weight-gradient pass bypasses FSDP's gradient hooks)"
    return fsdp_refusal(profile, cfg.tp) or "FSDP (zero 2 / 3) needs more than one data-parallel rank"


def _memory_rejection(cfg: ParallelConfig, bound_s: float, need_bytes: float | None, capacity_bytes: float,
                      what: str) -> Rejection:
    why = (f"{what} need {fmt_gib(need_bytes)} per GPU, {fmt_gib(need_bytes - capacity_bytes)} over its "
           f"{fmt_gib(capacity_bytes)}" if need_bytes is not None else f"{what} fits {fmt_gib(capacity_bytes)} per GPU")
    return Rejection("memory", cfg.describe(), why, bound_s, need_bytes, capacity_bytes, pins=config_pins(cfg))


def _bound_rejection(cfg: ParallelConfig, bound_s: float, cutoff_s: float, top: int) -> Rejection:
    return Rejection("bound", cfg.describe(), f"its step time is at least {bound_s:.4g} s, no faster than the "
                     f"#{top} plan kept at the time ({cutoff_s:.4g} s)", bound_s, pins=config_pins(cfg))


def explain_memory(ctx: SearchContext, rejections: Rejections, pins: dict, sp_allowed: bool) -> None:
    """For each kept over-memory rejection: the memory it needs (`min_memory_bytes`) and the first
    change, of those a user can pin, that fits under the model ([Note: recording rejections]).
    Only with `explain`: a few cuttings and evaluations per kept configuration."""
    kept = rejections._kept["memory"]
    for index, (rank, order, key, make, cfg) in enumerate(kept):
        rejection = make()
        capacity = rejection.capacity_bytes
        need = min_memory_bytes(ctx, cfg)
        static_only = rejection.why.startswith("its weights")
        if need is not None and (rejection.need_bytes is None or need > rejection.need_bytes):
            rejection.need_bytes = need
            static_only = False  # the best cutting's whole need: its activations in flight included
        if rejection.need_bytes is not None:
            rejection.why = (f"needs about {fmt_gib(rejection.need_bytes)} per GPU, "
                             f"{fmt_gib(rejection.need_bytes - capacity)} over its {fmt_gib(capacity)}"
                             + (" (its weights, gradients and optimizer states alone)" if static_only
                                else " (the least any cutting needs, activations in flight included)"))
        fixed = memory_fix(ctx, cfg, pins, sp_allowed)
        if fixed is not None:
            rejection.fix, rejection.fix_pins = fixed
        kept[index] = (rank, order, key, (lambda r=rejection: r), cfg)


def _split(plan: Plan) -> str:
    """The plan's degrees as the table shows them (report/tables.py `layout_label`): dp is the
    replicas the batch is split over (`plan.replicas`; `plan.dp` also counts the cp ranks), and cp its
    own degree, so tp x pp x dp x cp is the GPU count (issue 44: "dp 2" and "cp 2" in one note, 64
    GPUs on a 32-GPU cluster, against the table's 8/2/1/2)."""
    extras = [plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
              f"recompute {plan.recompute}", f"micro-batch {plan.micro_batch_size}"]
    cp = f" cp {plan.cp}" if plan.cp > 1 else ""
    return f"tp {plan.tp} pp {plan.pp} dp {plan.replicas}{cp}, " + ", ".join(extras)


def _slower(other: Plan, chosen: Plan) -> str:
    """"N% slower", with the digits the gap needs: a 0.27% gap reads "0.3% slower", not "0% slower"."""
    gap = other.predicted.step_time_s / chosen.predicted.step_time_s - 1
    if gap >= 0.095:
        return f"{gap:.0%} slower"
    if gap >= 0.0005:
        return f"{gap:.1%} slower"
    return "less than 0.1% slower" if gap > 0 else "as fast"


def _sharding(plan: Plan) -> str:
    # ZeRO and FSDP shard over every data-parallel rank, the cp ranks of a replica included: said as
    # the table's degrees, so "over 4 ranks" is not read against a table that shows dp 2.
    ranks = f"{plan.dp} ranks" + (f" (dp {plan.replicas} x cp {plan.cp})" if plan.cp > 1 else "")
    if plan.zero >= 2:
        over = (f"HSDP: FSDP over {plan.dp_shard} ranks, {plan.dp_replicate} replicas" if plan.dp_replicate > 1
                else f"FSDP over {ranks}")
        reduced = ", gradients reduced in bf16" if plan.reduce_dtype == "bfloat16" else ""
        return f"zero {plan.zero} ({over}{reduced})"
    if plan.zero == 1:
        return f"zero 1 (optimizer states and fp32 masters sharded over {ranks})"
    return "zero 0 (replicated)"


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"


def _fmt_share(share: float) -> str:
    """A share of the step: "5%", "0.4%" (not "0%" for a share that is there)."""
    return f"{share:.0%}" if share >= 0.095 or share == 0 else f"{share:.1%}" if share >= 0.0005 else "<0.1%"


def _fmt_bytes(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def _peak_stage(plan: Plan):
    return max(plan.stages, key=lambda s: s.memory.total_bytes).memory


def _sharding_note(ctx: SearchContext, chosen: Plan, best_by_kind: dict[bool, Plan], pins: dict) -> str | None:
    """Which data-parallel sharding the best plan uses and why, against the best plan of the other
    kind the search found ([Note: sharded data parallelism in the search])."""
    pinned = "zero" in pins or pins.get("dp_replicate", 1) > 1
    if chosen.zero < 2 and (chosen.dp == 1 or pinned):
        return None
    gib = 2**30
    capacity = min(g.mem_bytes for g in ctx.cluster.gpu_types)
    fsdp = chosen.zero >= 2
    other = best_by_kind.get(not fsdp)
    slower = _slower(other, chosen) if other is not None else None
    parts = [_sharding(chosen) + (" (pinned)" if pinned else "")]
    if fsdp:
        memory = _peak_stage(chosen)
        others = memory.total_bytes - memory.activations_bytes
        persistent = memory.weights_bytes + memory.grads_bytes + memory.optimizer_bytes
        parts[0] += (f": 16 B/param / {chosen.dp_shard} keeps {_fmt_bytes(persistent)} of weights, gradients and Adam "
                     f"state per GPU and leaves {_fmt_bytes(capacity - others)} for activations")
        if not pinned:
            same = ParallelConfig(
                tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, micro_batch_size=chosen.micro_batch_size,
                num_microbatches=chosen.num_microbatches, schedule=chosen.schedule,
                virtual_stages=chosen.virtual_stages, recompute=chosen.recompute,
                zero=1 if chosen.dp > 1 else 0,
                sequence_parallel=chosen.sequence_parallel, rank_order=chosen.rank_order, cp=chosen.cp, ep=chosen.ep,
                expert_tp=chosen.expert_tp)
            zero1 = evaluate(ctx, same, require_fit=False)
            if zero1 is not None and not zero1.plan.fits:
                parts.append(f"the same split with zero {same.zero} needs "
                             f"{zero1.plan.predicted.peak_memory_bytes / gib:.0f} GiB per GPU ({capacity / gib:.0f} "
                             "available)")
            if other is not None:
                parts.append(f"the best zero-{other.zero} plan ({_split(other)}) is {slower}")
            else:
                parts.append("no zero-0/1 plan fit or came within the search's step-time cutoff")
        exposed = chosen.predicted.breakdown.get(Term.FSDP_COMM_EXPOSED, 0.0) + \
            chosen.predicted.breakdown.get(Term.DP_COMM_EXPOSED, 0.0)
        parts.append(f"all-gathers and reduce-scatters hidden behind compute except {_fmt_ms(exposed)} per step "
                     f"({_fmt_share(exposed / chosen.predicted.step_time_s)})")
    elif other is not None:
        exposed = other.predicted.breakdown.get(Term.FSDP_COMM_EXPOSED, 0.0) + \
            other.predicted.breakdown.get(Term.DP_COMM_EXPOSED, 0.0)
        parts.append(f"the best FSDP plan, {_sharding(other)} with {_split(other)}, is {slower}: its all-gathers and "
                     f"reduce-scatters leave {_fmt_ms(exposed)} per step exposed")
    else:
        parts.append("no FSDP plan (zero 2/3) beat it: where zero 1 fits, FSDP only adds parameter all-gathers")
    return "; ".join(parts)


def _context_note(ctx: SearchContext, chosen: Plan, best_by_cp: dict[bool, Plan], pins: dict) -> str:
    """Why the best plan has its context-parallel degree: the tokens a GPU keeps, what the key/value
    all-gathers cost, and the best plan of the other kind."""
    other = best_by_cp.get(chosen.cp == 1)
    seq = chosen.job.seq_len
    if chosen.cp > 1:
        gathers = chosen.predicted.breakdown.get(Term.CP_COMM, 0.0)
        parts = [f"cp {chosen.cp}{' (pinned)' if 'cp' in pins else ''}: each GPU holds {seq // chosen.cp:,} of the "
                 f"{seq:,} tokens of its sequences (activations / {chosen.cp}) for {_fmt_ms(gathers)} of key/value "
                 f"all-gathers per step ({_fmt_share(gathers / chosen.predicted.step_time_s)}); {chosen.replicas} "
                 f"replica{'s' if chosen.dp // chosen.cp > 1 else ''} take{'' if chosen.dp // chosen.cp > 1 else 's'} "
                 "distinct batches"]
        if other is not None:
            parts.append(f"the best plan without context parallelism ({_split(other)}) is {_slower(other, chosen)}")
        else:
            parts.append("no plan without context parallelism fit or came within the search's step-time cutoff")
        # What cp computes otherwise than one process (graph/positions.py `sequence_split_note`).
        changed = (ctx.profile.extra.get("context_parallel") or {}).get("note")
        if changed:
            parts.append(changed)
        return "; ".join(parts)
    if other is not None:
        return f"cp 1: the best plan with context parallelism ({_split(other)}) is {_slower(other, chosen)}"
    return "cp 1 (pinned)" if pins.get("cp") == 1 else "cp 1: no plan with cp > 1 fit or came within the cutoff"


def _expert_note(ctx: SearchContext, chosen: Plan, best_by_ep: dict[bool, Plan], pins: dict) -> str:
    """Why the best plan of a mixture-of-experts model has the expert-parallel degree it has: the
    memory ep saves, what its all-to-alls cost, and the best plan of the other kind."""
    other = best_by_ep.get(chosen.ep == 1)
    experts = ctx.profile.extra["experts"]
    if chosen.ep == 1 and chosen.expert_tp > 1:
        exchange = chosen.predicted.breakdown.get(Term.EP_COMM, 0.0)
        return (f"ep 1, expert tp {chosen.expert_tp}{' (pinned)' if 'expert_tp' in pins else ''}: each GPU holds "
                f"1/{chosen.expert_tp} of the hidden units of all {experts['num_experts']} experts of its layers and "
                f"runs them on its replica's tokens, for {_fmt_ms(exchange)} of all-reduces of their outputs per step "
                f"({_fmt_share(exchange / chosen.predicted.step_time_s)})")
    if chosen.ep > 1:
        exchange = chosen.predicted.breakdown.get(Term.EP_COMM, 0.0)
        cfg = ParallelConfig.of_plan(chosen)
        tokens = (f"the tokens of {chosen.ep} ranks over tp x dp, each bringing 1/{cfg.expert_token_split} of a "
                  "replica's" if cfg.expert_token_split > 1 else f"the tokens of {chosen.ep} replicas")
        hidden = f" (1/{chosen.expert_tp} of each one's hidden units)" if chosen.expert_tp > 1 else ""
        parts = [f"ep {chosen.ep}{' (pinned)' if 'ep' in pins else ''}: each GPU computes 1/{chosen.ep} of the "
                 f"{experts['num_experts']} experts of its layers{hidden} for {tokens}, "
                 f"for {_fmt_ms(exchange)} of expert communication per step "
                 f"({_fmt_share(exchange / chosen.predicted.step_time_s)})", _links_line(ctx.cluster, cfg)]
        if chosen.zero >= 2 and chosen.dp_replicate > 1:
            parts.append(f"HSDP shards those experts over {cfg.expert_dp // chosen.dp_replicate} of the "
                         f"{cfg.expert_dp} ranks holding the same ones and replicates them {chosen.dp_replicate} times")
        elif chosen.zero >= 1 and cfg.expert_dp == 1:
            parts.append("no other rank holds the same experts: ZeRO leaves them whole")
        elif chosen.zero >= 2:
            parts.append(f"FSDP shards those experts over the {cfg.expert_dp} ranks holding the same ones")
        elif chosen.zero == 1:
            parts.append(f"zero 1 shards their optimizer state over the {cfg.expert_dp} ranks holding the same ones")
        else:
            total = sum(experts["block_params"]) * (1 - 1 / (chosen.ep * chosen.expert_tp)) / chosen.pp
            parts.append(f"about {_fmt_params(total)} fewer parameters per GPU than without ep (zero 0)")
        if other is not None:
            parts.append(f"the best plan without expert parallelism ({_sharding(other)}, {_split(other)}) is "
                         f"{_slower(other, chosen)}")
        return "; ".join(parts)
    if other is not None:
        return (f"ep 1: the best plan with expert parallelism ({_split(other)}, ep {other.ep}, {_sharding(other)}) is "
                f"{_slower(other, chosen)}")
    why = "pinned" if pins.get("ep") == 1 else (
        "no plan with ep > 1 fit or came within the search's step-time cutoff (under the pinned HSDP ep must "
        "divide tp x dp_shard)" if (pins.get("dp_replicate") or 1) > 1 else
        "no plan with ep > 1 fit or came within the search's step-time cutoff")
    return f"ep 1: {why}"


def _fmt_params(count: float) -> str:
    """A parameter count in the unit it reads in: "1.20B", "52.3K" (a small model's "0.00B" said nothing)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:,.0f}"


def _links_line(cluster: Cluster, cfg: ParallelConfig) -> str:
    """`ExpertLinks.describe`, with the cluster's own intra-node link named: a CPU node's ranks talk
    over shared memory, not NVLink (issue 43: "1 peer over NVLink" on a CPU cluster)."""
    line = expert_links(cluster, cfg).describe()
    kind = cluster.intra_node.kind
    return line if kind == "NVLink" else line.replace("over NVLink", f"over {kind}" if kind else "inside the node")


def pre_cut_bound(cfg: ParallelConfig, total_s: float, fwd_share: float) -> float:
    """A lower bound on the step time valid for every cutting, from T = the sum of all block times
    per micro-batch.

    Pipeline rank r is busy m * t_r after the forwards of the earlier ranks' stages and (GPipe,
    1F1B) before their backwards, so step >= S_r + m t_r with S_r the time of the stages before it
    (see `bounds.step_lower_bound`). Minimizing max_r over every split of T makes all terms
    equal: L - S_{r+1} = (L - S_r)(1 - 1/m), hence L = T / (1 - (1 - 1/m)^p) >= m T / p. Zero-bubble
    only waits for earlier forwards, a share phi >= fwd_share of each stage: L = phi T / (1 - (1 -
    phi/m)^p). Interleaving waits only for chunk-0 stages, so it gets the plain m T / p.
    """
    m, p = cfg.num_microbatches, cfg.pp
    plain = m * total_s / p
    spec = schedule_spec(cfg.schedule)
    if p == 1 or spec.looped:
        return plain
    phi = fwd_share if spec.split_backward else 1.0
    return max(plain, phi * total_s / (1 - (1 - phi / m) ** p))


def fsdp_floor_s(ctx: SearchContext, cfg: ParallelConfig) -> float:
    """A lower bound on the step time of an FSDP configuration (zero >= 2), valid for every cutting:
    a pass over units takes at least its compute and at least the communication it overlaps
    (cost/comm.py `prefetch_exposed_s`: compute + exposed >= sum of all-gathers + reductions), so
    pipeline rank r is busy m * (max(F_r, A_r) + max(B_r, A_r + R_r)) at least, and the busiest rank
    at least the mean over ranks. Gathers count in both passes under zero 3, reductions in the
    backward with pp = 1; each unit at the cheapest of its pipeline ranks' groups."""
    if cfg.dp <= 1:
        return 0.0
    gpu = max(ctx.cluster.gpu_types, key=lambda g: g.peak(ctx.job.dtype))  # the fastest: a bound for every rank
    fwd, bwd = ctx.block_passes(ctx.block_times(gpu, cfg))
    comm = [ctx.fsdp_unit_times(cfg, p) for p in range(cfg.pp)]
    gather = np.min([g for g, _ in comm], axis=0).sum() if cfg.zero == 3 else 0.0
    reduce = np.min([r for _, r in comm], axis=0).sum() if cfg.pp == 1 else 0.0
    per_microbatch = max(float(fwd.sum()), gather) + max(float(bwd.sum()), gather + reduce)
    return cfg.num_microbatches * per_microbatch / cfg.pp


def _fwd_share(ctx: SearchContext, cfg: ParallelConfig) -> float:
    """The smallest forward / (forward + backward) ratio of any block on any GPU type (for
    `pre_cut_bound`, which grows with the share: the smallest keeps it a bound)."""
    shares = []
    for gpu in ctx.cluster.gpu_types:
        times = ctx.block_times(gpu, cfg)
        fwd = times.fwd_s + times.tp_fwd_s
        total = times.total_s
        shares.append(float(np.min(np.where(total > 0, fwd / np.where(total > 0, total, 1), 1.0))))
    return min(shares)


def _same_but_layout(a: Plan, b: Plan) -> bool:
    keys = ("micro_batch_size", "schedule", "recompute", "zero", "sequence_parallel", "reduce_dtype")
    return (all(getattr(a, k) == getattr(b, k) for k in keys)
            and a.layout_key(CONFIG_KEY_LEAVES_OUT) == b.layout_key(CONFIG_KEY_LEAVES_OUT))


def _raise_no_plan(ctx: SearchContext, cluster: Cluster, pins: dict, sp_allowed: bool, advise: bool,
                   result: SearchResult) -> None:
    from autoplan.search.advice import no_plan_message  # the error path only

    raise NoPlanError(no_plan_message(ctx, cluster, pins, sp_allowed, advise, search=search_plans), result)
