"""The configurations the search may try: pins checked before any search, the degrees each
dimension allows (and why one is refused), the base configurations, their sharding and memory
options, and the first change that makes a configuration fit.

Apart from space.py (which orders, prunes and ranks these configurations) so that search/advice.py,
which space.py calls once nothing fits, reads them without importing space.py back (issue 30: no
import circle). [Note: search order and pruning] and [Note: sharded data parallelism in the search]
in space.py say how the search uses them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

from autoplan.cluster import Cluster
from autoplan.cost.config import ParallelConfig
from autoplan.graph.blocks import ModelProfile
from autoplan.layout import LAYOUT_FIELDS
from autoplan.plan import MAX_MICROBATCHES, RECOMPUTE, REDUCE_DTYPES, Job, expert_layout_refusal
from autoplan.schedule import SCHEDULE_SPECS, SCHEDULES, schedule_spec
from autoplan.search.context import SearchContext
from autoplan.search.evaluate import evaluate
from autoplan.search.rejections import Rejection, Rejections

__all__ = ["DEFAULT_MBS", "MAX_MICROBATCHES", "PINS", "SEARCHED_SCHEDULES", "NoPlanError", "PlanningError", "base_configs",
           "check_pins", "config_pins", "cp_refusal", "ep_refusal", "fmt_gib", "frugal_config", "fsdp_allowed",
           "fsdp_refusal", "memory_fix", "sequence_parallel_allowed", "shardings", "tp_degrees_possible", "tp_refusal",
           "with_memory_options"]

_FIRST_PINS = ("tp", "pp", "dp", "micro_batch_size", "schedule", "virtual_stages", "recompute", "zero",
               "dp_replicate", "sequence_parallel", "rank_order", "ep", "cp", "reduce_dtype")
PINS = (*_FIRST_PINS, *(name for name in LAYOUT_FIELDS if name not in _FIRST_PINS))
"""What `suggest` may pin: the choices and every layout field (pins are a partial `Layout`)."""
DEFAULT_MBS = (1, 2, 4, 8)
# MAX_MICROBATCHES (autoplan/plan.py): micro-batches per replica per step above which a configuration is
# not considered, the same bound a plan file is checked against.
_DEFAULT_V = (2, 3, 4, 6)
_LOOPED = tuple(name for name, spec in SCHEDULE_SPECS.items() if spec.looped)
"""The looped schedules (several stages per rank), interleaved-1f1b alone today."""


class PlanningError(ValueError):
    """The job cannot be planned as asked (impossible pins, a model too large, ...)."""


class NoPlanError(PlanningError):
    """A search ran and no configuration gave a plan. `result` is what it did (space.SearchResult with
    no plans: the counts, and with `explain` the closest rejected configurations and why), so that
    `--explain` and `--json` still answer when nothing fits (issue 44)."""

    def __init__(self, message: str, result: object = None):
        super().__init__(message)
        self.result = result



def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_pins(profile: ModelProfile, cluster: Cluster, job: Job, pins: dict) -> None:
    """One-line errors for pins that cannot work, before any search."""
    unknown = set(pins) - set(PINS)
    if unknown:
        raise PlanningError(f"unknown pin {sorted(unknown)[0]!r}; pins are {', '.join(PINS)}")
    n_gpus, per_node = cluster.num_gpus, cluster.gpus_per_node
    for key in ("tp", "pp", "dp", "micro_batch_size", "virtual_stages", "dp_replicate", "ep", "cp", "expert_tp"):
        value = pins.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise PlanningError(f"--{key.replace('_', '-')} {value!r} must be a positive integer")
    tp, pp, dp = pins.get("tp"), pins.get("pp"), pins.get("dp")
    if tp is not None:
        if tp > per_node or per_node % tp:
            raise PlanningError(f"--tp {tp} must divide the {per_node} GPUs of a node (TP stays inside a node)")
        refusal = tp_refusal(profile, tp)
        if refusal is not None:
            raise PlanningError(f"--tp {tp} {refusal}" if refusal.startswith("does not") else
                                f"--tp {tp}: {refusal}; use --tp 1")
    if pp is not None and pp > profile.num_blocks:
        raise PlanningError(f"--pp {pp} is more than the model's {profile.num_blocks} blocks")
    product = math.prod(v for v in (tp, pp, dp) if v is not None)
    if n_gpus % product:
        raise PlanningError(f"pinned degrees multiply to {product}, which does not divide the cluster's {n_gpus} GPUs")
    if None not in (tp, pp, dp) and product != n_gpus:
        raise PlanningError(f"tp*pp*dp = {tp}*{pp}*{dp} = {product} but the cluster has {n_gpus} GPUs")
    cp = pins.get("cp") or 1
    if cp > 1:
        refusal = cp_refusal(profile, job, cp)
        if refusal is not None:
            raise PlanningError(f"--cp {cp} {refusal}")
        if dp is not None and dp % cp:
            raise PlanningError(f"--cp {cp} must divide --dp {dp}: sequences are split over data-parallel ranks")
        if n_gpus % (product * cp) and dp is None:
            raise PlanningError(f"--cp {cp} does not divide the data-parallel degree of any split of {n_gpus} GPUs "
                                "with the pinned degrees")
    if dp is not None and (dp % cp or job.global_batch % (dp // cp)):
        raise PlanningError(f"global batch {job.global_batch} is not divisible by --dp {dp}"
                            + (f" / --cp {cp}" if cp > 1 else ""))
    mbs = pins.get("micro_batch_size")
    if mbs is not None and dp is not None and (job.global_batch // (dp // cp)) % mbs:
        raise PlanningError(f"the per-replica batch {job.global_batch // (dp // cp)} is not divisible by "
                            f"--micro-batch-size {mbs}")
    if mbs is not None and job.global_batch % mbs:
        raise PlanningError(f"global batch {job.global_batch} is not divisible by --micro-batch-size {mbs}")
    schedule = pins.get("schedule")
    if schedule is not None and schedule not in SCHEDULES:
        raise PlanningError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    v = pins.get("virtual_stages")
    if v is not None and v > 1 and schedule is not None and not schedule_spec(schedule).looped:
        raise PlanningError(f"--virtual-stages {v} needs --schedule {' or '.join(_LOOPED)}")
    if schedule is not None and schedule_spec(schedule).looped and v == 1:
        raise PlanningError(f"{schedule} needs --virtual-stages of at least 2")
    if v is not None and pp is not None and pp * v > profile.num_blocks:
        raise PlanningError(f"pp*virtual_stages = {pp * v} stages is more than the model's {profile.num_blocks} blocks")
    recompute = pins.get("recompute")
    if recompute is not None and recompute not in RECOMPUTE:
        raise PlanningError(f"unknown recompute {recompute!r}; use one of {', '.join(RECOMPUTE)}")
    zero = pins.get("zero")
    if zero is not None and (zero not in (0, 1, 2, 3) or isinstance(zero, bool)):
        raise PlanningError(f"--zero {zero!r} must be 0, 1, 2 or 3")
    replicate = pins.get("dp_replicate")
    if replicate is not None and replicate > 1:
        if zero is not None and zero < 2:
            raise PlanningError(f"--dp-replicate {replicate} (HSDP) shards parameters inside groups of dp / {replicate} "
                                f"ranks, which needs --zero 2 or 3, not --zero {zero}")
        if dp is not None and dp % replicate:
            raise PlanningError(f"--dp-replicate {replicate} must divide --dp {dp}")
        if n_gpus % (product * replicate) and dp is None:
            raise PlanningError(f"--dp-replicate {replicate} does not divide the data-parallel degree of any split of "
                                f"{n_gpus} GPUs with the pinned degrees")
    fsdp_pinned = (zero is not None and zero >= 2) or (replicate is not None and replicate > 1)
    reduce_dtype = pins.get("reduce_dtype")
    if reduce_dtype is not None:
        if reduce_dtype not in REDUCE_DTYPES:
            raise PlanningError(f"--reduce-dtype {reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}")
        if reduce_dtype == "bfloat16" and (zero is None or zero < 2) and not (replicate and replicate > 1):
            raise PlanningError("--reduce-dtype bfloat16 is FSDP's reduce dtype: pin --zero 2 or 3 with it (zero 0 "
                                "and 1 reduce fp32 gradients)")
        if reduce_dtype == "bfloat16" and job.dtype != "bfloat16":
            raise PlanningError(f"--reduce-dtype bfloat16 needs --dtype bfloat16, not {job.dtype}")
    if schedule is not None and not schedule_spec(schedule).runs_fsdp and fsdp_pinned:
        what = f"--zero {zero}" if zero is not None and zero >= 2 else f"--dp-replicate {replicate}"
        raise PlanningError(f"--schedule {schedule} cannot run with {what} (FSDP): its weight-gradient pass runs outside "
                            "autograd, where FSDP's gradient hooks do not see it; use --zero 1 or another schedule")
    if fsdp_pinned and tp is not None and fsdp_refusal(profile, tp) is not None:
        raise PlanningError(f"--tp {tp} with {'--zero ' + str(zero) if zero else '--dp-replicate'}: "
                            f"{fsdp_refusal(profile, tp)}; use --zero 1 or --tp 1")
    etp = pins.get("expert_tp")
    if etp is not None and etp > 1:
        if not profile.extra.get("experts"):
            raise PlanningError(f"--expert-tp {etp} needs a mixture-of-experts model (graph/experts.py); this model "
                                "has none; use --expert-tp 1")
        if tp is None or etp != tp:
            raise PlanningError(f"--expert-tp {etp} must be 1 or the attention's --tp, pinned with it (the degrees "
                                f"built){'' if tp is None else f'; --tp is {tp}'}")
    ep = pins.get("ep")
    if ep is not None and ep > 1:
        refusal = ep_refusal(profile, ep)
        if refusal is not None:
            raise PlanningError(f"--ep {ep} {refusal}")
        layout = (expert_layout_refusal(ep, tp, dp, replicate or 1, etp or 1) if dp is not None and tp is not None
                  else None)
        if layout is not None:
            raise PlanningError(f"--{layout}; pin other degrees")
        if n_gpus % ep:
            raise PlanningError(f"--ep {ep} does not divide the {n_gpus} GPUs; experts are split over tp x dp ranks")
        if etp and etp > 1 and dp is None:  # tp is pinned with it (above)
            # Under expert tp the ep groups are replicas (plan.py [Note: expert layout]): some dp the
            # pinned degrees leave must take ep (under HSDP, its dp_shard).
            pps = [pp] if pp is not None else [p for p in range(1, n_gpus // tp + 1) if (n_gpus // tp) % p == 0]
            dps = sorted({n_gpus // (tp * p) for p in pps if n_gpus % (tp * p) == 0})
            if not any(expert_layout_refusal(ep, tp, d, replicate or 1, etp) is None
                       for d in dps if d % (replicate or 1) == 0):
                over = "dp_shard" if replicate and replicate > 1 else "dp"
                raise PlanningError(f"--ep {ep} must divide {over} under --expert-tp {etp} (the replicas the experts are "
                                    f"split over), and the pinned degrees leave dp {', '.join(map(str, dps))}; pin "
                                    "other degrees")
    if pins.get("sequence_parallel") and tp == 1:
        raise PlanningError("--sequence-parallel needs --tp of at least 2")
    if pins.get("sequence_parallel") and not sequence_parallel_allowed(profile):
        raise PlanningError("--sequence-parallel needs transformer layers (norms, sharded attention and MLP) that the "
                            "traced graph calls whole; this model's layout has none")


_COUNT_NAMES = {"num_heads": "attention heads", "num_kv_heads": "key/value heads", "ffn_hidden_size": "MLP width",
                "vocab_size": "vocabulary size"}


def tp_refusal(profile: ModelProfile, tp: int) -> str | None:
    """Why the model cannot run at this tensor-parallel degree (one line), or None.

    From the layout the profile records (`extra["tensor_parallel"]`, graph/sharding.py): tp must
    divide every count it lists. A profile without one (an older JSON) falls back to the heads."""
    if tp == 1:
        return None
    info = profile.extra.get("tensor_parallel")
    if info is None:
        if profile.num_heads and profile.num_heads % tp:
            return f"does not divide the model's {profile.num_heads} attention heads"
        if profile.num_kv_heads and profile.num_kv_heads % tp and tp % profile.num_kv_heads:
            return f"the model's {profile.num_kv_heads} key/value heads and tp do not divide one another"
        return None
    if info.get("note"):
        return f"the model has no tensor-parallel layout: {info['note']}"
    for name, count in info.get("divides", {}).items():
        if count % tp:
            return f"does not divide the model's {count} {_COUNT_NAMES.get(name, name)}"
    return None


def ep_refusal(profile: ModelProfile, ep: int) -> str | None:
    """Why the model cannot run at this expert-parallel degree (one line), or None: it has no
    experts that take tokens grouped by expert (graph/experts.py), or ep does not divide them."""
    if ep == 1:
        return None
    experts = profile.extra.get("experts")
    if not experts:
        return ("needs a mixture-of-experts model whose experts take tokens grouped by expert (graph/experts.py); "
                "this model has none; use --ep 1")
    if experts["num_experts"] % ep:
        return f"does not divide the model's {experts['num_experts']} experts; use a divisor of it"
    return None


def _expert_degrees(profile: ModelProfile, tp: int, dp: int, pins: dict) -> list[int]:
    """Expert-parallel degrees a base configuration tries: the pin, else every divisor of tp x dp
    (the ranks the experts fold over, plan.py [Note: expert layout]) that divides the experts (1 for
    a model without experts). A pinned zero 1 or HSDP keeps them: ZeRO-1 and FSDP shard the experts
    over the ranks holding them (cost/memory.py `expert_shard_surplus`); `shardings` says which
    ZeRO levels and HSDP degrees run with each ep."""
    width = tp // (pins.get("expert_tp") or 1)  # positions per replica (plan.py [Note: expert layout])
    if pins.get("ep"):
        return [pins["ep"]] if (width * dp) % pins["ep"] == 0 else []
    if not profile.extra.get("experts"):
        return [1]
    return [e for e in _divisors(width * dp) if ep_refusal(profile, e) is None]


MIN_TOKENS_PER_CP_RANK = 4096
"""Context-parallel degrees that leave a rank fewer tokens of a sequence than this are not searched
(`--cp` pins any degree): context parallelism is for long sequences (Llama 3 ran 131,072 tokens
over cp 16, 8,192 per rank, and 8,192-token sequences without it, arXiv:2407.21783 Table 4), and
every degree searched multiplies the configurations: with 1,024, llama3-405b at 8,192 tokens on
16,384 GPUs evaluated three times as many as with 4,096 (docs/cost-model.md, "Context
parallelism"). A search heuristic, not a measured threshold."""


def cp_refusal(profile: ModelProfile, job: Job, cp: int) -> str | None:
    """Why the model or job cannot run at this context-parallel degree (one line), or None."""
    if cp == 1:
        return None
    support = profile.extra.get("context_parallel") or {"allowed": False, "note": "the profile predates it"}
    if not support.get("allowed"):
        return f"needs a model context parallelism can split: {support.get('note')}"
    if job.seq_len % (2 * cp):
        return f"does not divide the sequence of {job.seq_len} tokens into 2 * {cp} equal chunks"
    return None


def _context_degrees(profile: ModelProfile, job: Job, dp: int, pins: dict) -> list[int]:
    """Context-parallel degrees a base configuration tries: the pin, else the divisors of dp the
    model takes that leave each rank at least MIN_TOKENS_PER_CP_RANK tokens (1 always)."""
    if pins.get("cp"):
        return [pins["cp"]] if dp % pins["cp"] == 0 else []
    if pins.get("ep", 1) > 1:
        return [1]
    return [c for c in _divisors(dp) if c == 1 or (cp_refusal(profile, job, c) is None
                                                  and job.seq_len // c >= MIN_TOKENS_PER_CP_RANK)]


def sequence_parallel_allowed(profile: ModelProfile) -> bool:
    info = profile.extra.get("tensor_parallel")
    return True if info is None else bool(info.get("sequence_parallel"))


def base_configs(profile: ModelProfile, cluster: Cluster, job: Job, pins: dict,
                  reject: Rejections | None = None) -> Iterator[ParallelConfig]:
    """Every base configuration (memory options left at their fastest), see the module note.
    `reject` counts (and keeps the first few of) the splits the batch or the model's layout refuse."""
    n_gpus, per_node = cluster.num_gpus, cluster.gpus_per_node
    tps = [pins["tp"]] if pins.get("tp") else [t for t in _divisors(per_node) if tp_refusal(profile, t) is None]
    if reject is not None and not pins.get("tp"):
        for t in tp_degrees_possible(profile, cluster, pins):
            why = tp_refusal(profile, t)
            if why is not None:
                reject.add("layout", t, ("tp", t), functools.partial(
                    Rejection, "layout", f"tp={t}", f"tp {t} {why}" if why.startswith("does not") else why))
    for tp in tps:
        pps = [pins["pp"]] if pins.get("pp") else [p for p in _divisors(n_gpus // tp) if p <= profile.num_blocks]
        for pp in pps:
            if (n_gpus // tp) % pp:
                continue
            dp = n_gpus // (tp * pp)
            if pins.get("dp") not in (None, dp) or dp % pins.get("dp_replicate", 1):
                continue
            for cp in _context_degrees(profile, job, dp, pins):
                replicas = dp // cp
                if job.global_batch % replicas:
                    if reject is not None:
                        reject.add("batch", 0.0, (tp, pp, dp, cp), functools.partial(
                            Rejection, "batch", f"tp={tp} pp={pp} dp={dp}" + (f" cp={cp}" if cp > 1 else ""),
                            f"the global batch {job.global_batch} does not split over {replicas} data-parallel "
                            "replicas"))
                    continue
                per_replica = job.global_batch // replicas
                mbss = [pins["micro_batch_size"]] if pins.get("micro_batch_size") else [
                    b for b in DEFAULT_MBS if per_replica % b == 0]
                for mbs in mbss:
                    if per_replica % mbs:
                        continue
                    m = per_replica // mbs
                    if m > MAX_MICROBATCHES:
                        if reject is not None:
                            reject.add("batch", 1.0, (tp, pp, dp, cp, mbs), functools.partial(
                                Rejection, "batch", f"tp={tp} pp={pp} dp={dp} mbs={mbs}x{m}",
                                f"{m} micro-batches per replica, more than the {MAX_MICROBATCHES} searched "
                                "(MAX_MICROBATCHES); a larger micro-batch or more GPUs"))
                        continue  # see MAX_MICROBATCHES
                    schedules = _schedules(profile, pp, m, pins)
                    if reject is not None and pp > 1 and m % pp and pins.get("schedule") in (None, *_LOOPED):
                        reject.add("batch", 2.0, (tp, pp, dp, cp, mbs, _LOOPED[0]), functools.partial(
                            Rejection, "batch", f"tp={tp} pp={pp} dp={dp} mbs={mbs}x{m} {_LOOPED[0]}",
                            f"interleaved 1F1B runs micro-batches in groups of pp: {m} is not a multiple of {pp}"))
                    for schedule, v in schedules:
                        orders = [pins["rank_order"]] if pins.get("rank_order") else (
                            ["tp-dp-pp", "tp-pp-dp"] if pp > 1 and dp > 1 and cluster.num_nodes > 1 else ["tp-dp-pp"])
                        for order in orders:
                            # ep with cp where pinned: the search leaves it out of long-sequence
                            # searches, whose configurations cp already multiplies
                            for ep in _expert_degrees(profile, tp, dp, pins) if cp == 1 or pins.get("ep") else [1]:
                                yield ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, num_microbatches=m,
                                                     schedule=schedule, virtual_stages=v, rank_order=order, ep=ep,
                                                     cp=cp, reduce_dtype=pins.get("reduce_dtype", "float32"),
                                                     expert_tp=pins.get("expert_tp") or 1)


def tp_degrees_possible(profile: ModelProfile, cluster: Cluster, pins: dict) -> list[int]:
    """The tp degrees (within a node) for which the GPU count and the pinned pp and dp leave a split:
    only these are worth saying the model refuses (issue 43: "tp 4 not considered: ... key/value heads"
    on 4 GPUs with --dp 4 pinned, where no tp 4 split exists anyway)."""
    n_gpus = cluster.num_gpus
    out = []
    for t in _divisors(cluster.gpus_per_node):
        if n_gpus % t:
            continue
        pps = [pins["pp"]] if pins.get("pp") else [p for p in _divisors(n_gpus // t) if p <= profile.num_blocks]
        if any((n_gpus // t) % p == 0 and pins.get("dp") in (None, n_gpus // (t * p)) for p in pps):
            out.append(t)
    return out


SEARCHED_SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")
"""The schedules the search tries, in its order; gpipe has 1F1B's bubble and holds more micro-batches
(schedule/specs.py), so it is only run when pinned."""


def _schedules(profile: ModelProfile, pp: int, m: int, pins: dict) -> list[tuple[str, int]]:
    pinned = pins.get("schedule")
    if (pins.get("virtual_stages") or 1) > 1:  # only a looped schedule has virtual stages: a pin of v > 1 is one
        pinned = pinned if pinned is not None and schedule_spec(pinned).looped else _LOOPED[0]
    if pp == 1:
        # One stage: every schedule is the same sequence of forwards and backwards.
        return [(pinned or "1f1b", 1)] if pinned is None or not schedule_spec(pinned).looped else []
    out = []
    fsdp_only = pins.get("zero", 0) >= 2 or pins.get("dp_replicate", 1) > 1
    for name in ([pinned] if pinned else [name for name in SEARCHED_SCHEDULES
                                          if schedule_spec(name).runs_fsdp or not fsdp_only]):
        if schedule_spec(name).looped:
            vs = [pins["virtual_stages"]] if pins.get("virtual_stages") else list(_DEFAULT_V)
            out += [(name, v) for v in vs if v >= 2 and pp * v <= profile.num_blocks and m % pp == 0]
        else:
            out.append((name, 1))
    return out


def _hsdp_replicate(cfg: ParallelConfig, gpus_per_node: int) -> int | None:
    """The HSDP replicate degree whose shard groups are one node's data-parallel ranks
    (tp * dp_shard = gpus_per_node), when that divides dp and leaves more than one group."""
    shard = gpus_per_node // cfg.tp
    if shard > 1 and cfg.dp % shard == 0 and cfg.dp // shard > 1:
        return cfg.dp // shard
    return None


def fsdp_refusal(profile: ModelProfile, tp: int) -> str | None:
    """Why FSDP (zero 2 / 3) cannot run the model at this tp (one line), or None: a fused q/k/v
    projection's tensor-parallel [q | k | v] thirds cannot be sharded again by FSDP along the same
    dim (the profile's layout records it, graph/sharding.py; runtime/parallel/fsdp.py refuses it too)."""
    info = profile.extra.get("tensor_parallel") or {}
    if tp > 1 and info.get("fused_qkv"):
        return (f"FSDP (zero 2 / 3) with tp {tp} cannot shard the model's fused q/k/v projection (its tensor-parallel "
                "[q | k | v] thirds along the dim FSDP shards)")
    return None


def shardings(cfg: ParallelConfig, pins: dict, gpus_per_node: int,
               profile: ModelProfile | None = None) -> list[tuple[int, int]]:
    """(zero, dp_replicate) options of a base configuration, in the order the ladder tries them
    ([Note: sharded data parallelism in the search]): ZeRO-1 (zero 0 with dp = 1), then zero 2 and
    zero 3, each over all of dp and as HSDP; no FSDP where `fsdp_refusal` says the model cannot."""
    zero, replicate = pins.get("zero"), pins.get("dp_replicate")
    if zero is not None and zero < 2:
        return [(zero, 1)]
    out = []
    if zero is None and replicate in (None, 1):
        out.append((1 if cfg.dp > 1 else 0, 1))
    if (zero is None and cfg.dp == 1) or not fsdp_allowed(cfg, profile):
        return out
    if replicate is not None:
        replicates = [replicate]
    else:
        hsdp = _hsdp_replicate(cfg, gpus_per_node)
        replicates = [1] if hsdp is None else [1, hsdp]
    # With ep each replica group holds every expert (plan.py [Note: expert layout])
    replicates = [r for r in replicates
                  if cfg.dp % r == 0 and expert_layout_refusal(cfg.ep, cfg.tp, cfg.dp, r, cfg.expert_tp) is None]
    out += [(z, r) for z in ([zero] if zero is not None else [2, 3]) for r in replicates]
    return out


def _with_experts_kept(cfg: ParallelConfig) -> ParallelConfig:
    """`cfg` with its ep where the changed degrees still take it (plan.py `expert_layout_refusal`),
    else ep 1; an expert tp of the old tp follows the new tp (the degrees built are 1 and tp)."""
    if cfg.expert_tp > 1 and cfg.expert_tp != cfg.tp:
        cfg = dataclasses.replace(cfg, expert_tp=cfg.tp)
    if cfg.ep > 1 and expert_layout_refusal(cfg.ep, cfg.tp, cfg.dp, cfg.dp_replicate, cfg.expert_tp) is not None:
        return dataclasses.replace(cfg, ep=1)
    return cfg


def fsdp_allowed(cfg: ParallelConfig, profile: ModelProfile | None) -> bool:
    """Whether the runtime can run this configuration with FSDP: not under zb-h1, nor where
    `fsdp_refusal` says the model cannot be sharded at its tp."""
    return schedule_spec(cfg.schedule).runs_fsdp and (profile is None or fsdp_refusal(profile, cfg.tp) is None)


def with_memory_options(cfg: ParallelConfig, pins: dict, sp_allowed: bool, recompute: str, zero: int,
                         replicate: int) -> ParallelConfig:
    """A rung: the base configuration with a recompute level and a data-parallel sharding. Sequence
    parallelism (when tp > 1 and the model's layout has layers for it, `sp_allowed`) is always on
    unless pinned: it costs no time in this model and only saves memory."""
    sp = pins["sequence_parallel"] if pins.get("sequence_parallel") is not None else cfg.tp > 1 and sp_allowed
    return dataclasses.replace(cfg, recompute=recompute, zero=zero, dp_replicate=replicate, sequence_parallel=sp)


def frugal_config(cfg: ParallelConfig, pins: dict, sp_allowed: bool = True, gpus_per_node: int = 1,
            profile: ModelProfile | None = None) -> ParallelConfig:
    """The rung that needs the least memory (most recompute, the most sharded option)."""
    recompute = pins["recompute"] if pins.get("recompute") else RECOMPUTE[-1]
    options = shardings(cfg, pins, gpus_per_node, profile)
    zero, replicate = min(options, key=lambda o: (o[0] < 2, o[1], -o[0]))  # FSDP over the most ranks, zero 3
    return with_memory_options(cfg, pins, sp_allowed, recompute, zero, replicate)



def fmt_gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def config_pins(cfg: ParallelConfig) -> dict:
    """The configuration as the pins `suggest` takes (every dimension but the rank layout). Layout
    fields added after the first ones (`Layout.later_fields`, expert tp the first) enter away from
    their default."""
    return {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "micro_batch_size": cfg.micro_batch_size,
            "schedule": cfg.schedule, "virtual_stages": cfg.virtual_stages, "recompute": cfg.recompute,
            "zero": cfg.zero, "dp_replicate": cfg.dp_replicate, "ep": cfg.ep, "cp": cfg.cp,
            "sequence_parallel": cfg.sequence_parallel,
            **({"reduce_dtype": cfg.reduce_dtype} if cfg.reduce_dtype != "float32" else {}),
            **cfg.later_fields()}


def memory_fix(ctx: SearchContext, cfg: ParallelConfig, pins: dict, sp_allowed: bool) -> tuple[str, dict] | None:
    """The first change that makes `cfg` fit, checked by evaluating it: a smaller micro-batch, zero 3,
    full recompute, twice the pipeline stages or twice the tensor parallelism; (what it gives, the
    pins it changes)."""
    profile, cluster, job = ctx.profile, ctx.cluster, ctx.job
    tries: list[tuple[str, ParallelConfig]] = []
    if cfg.micro_batch_size > 1:
        per_replica = cfg.micro_batch_size * cfg.num_microbatches
        if per_replica <= MAX_MICROBATCHES:
            tries.append(("--micro-batch-size 1", dataclasses.replace(cfg, micro_batch_size=1,
                                                                     num_microbatches=per_replica)))
    if cfg.zero < 3 and cfg.dp > 1 and fsdp_allowed(cfg, profile):
        tries.append(("--zero 3", dataclasses.replace(cfg, zero=3, dp_replicate=1)))
    if cfg.recompute != "full":
        tries.append(("--recompute full", dataclasses.replace(cfg, recompute="full")))
    if cfg.dp % 2 == 0 and cfg.pp * 2 * cfg.virtual_stages <= profile.num_blocks and cfg.cp == 1:
        replicas = cfg.dp // 2
        if job.global_batch % replicas == 0 and (job.global_batch // replicas) % cfg.micro_batch_size == 0:
            m = job.global_batch // replicas // cfg.micro_batch_size
            if cfg.virtual_stages == 1 or m % (cfg.pp * 2) == 0:
                tries.append((f"--pp {cfg.pp * 2}", _with_experts_kept(dataclasses.replace(
                    cfg, pp=cfg.pp * 2, dp=replicas, num_microbatches=m,
                    zero=cfg.zero if replicas > 1 or cfg.zero >= 2 else 0,
                    dp_replicate=cfg.dp_replicate if replicas % cfg.dp_replicate == 0 else 1))))
    tp = cfg.tp * 2
    if (cfg.dp % 2 == 0 and cluster.gpus_per_node % tp == 0 and tp_refusal(profile, tp) is None and cfg.cp == 1
            and (cfg.zero < 2 or fsdp_allowed(dataclasses.replace(cfg, tp=tp), profile))):
        replicas = cfg.dp // 2
        if job.global_batch % replicas == 0 and (job.global_batch // replicas) % cfg.micro_batch_size == 0:
            m = job.global_batch // replicas // cfg.micro_batch_size
            if cfg.virtual_stages == 1 or m % cfg.pp == 0:
                tries.append((f"--tp {tp}", _with_experts_kept(dataclasses.replace(
                    cfg, tp=tp, dp=replicas, num_microbatches=m, sequence_parallel=sp_allowed and
                    pins.get("sequence_parallel") is not False,
                    zero=cfg.zero if replicas > 1 or cfg.zero >= 2 else 0,
                    dp_replicate=cfg.dp_replicate if replicas % cfg.dp_replicate == 0 else 1))))
    for change, variant in tries:
        if variant.num_microbatches > MAX_MICROBATCHES:
            continue
        try:
            result = evaluate(ctx, variant)
        except (ValueError, AssertionError):
            continue
        if result is not None and result.plan.fits:
            plan = result.plan
            before, after = config_pins(cfg), config_pins(variant)
            return (f"{change}: fits in {fmt_gib(plan.predicted.peak_memory_bytes)}, {plan.predicted.step_time_s:.4g} s "
                    f"per step ({variant.describe()})", {k: v for k, v in after.items() if before[k] != v})
    return None
