"""The `Plan`: what to run and what it is predicted to do. Plain data, JSON, versioned.

A plan names the model (spec and structural fingerprint), the cluster, the job, every parallelism
choice, the stages as block ranges, and the prediction. `validate(plan)` is pure: it checks the
plan's own consistency (degrees multiply to the GPU count, TP inside a node, every block placed
once and in order, the schedule buildable, memory within capacity when the plan says it fits,
every predicted time, size and byte count finite and not negative, shares (MFU, HFU, bubble) in
their range, and the figures derived from others agreeing with them) without torch or a search, every
size checked before anything is built on it (a schedule is O(micro-batches x stages)). `Plan.load` and
`Plan.from_dict` refuse a plan that fails it; `Plan.load` also reads `autoplan suggest --json` output
(its best plan, or `plan_index`).

[Note: rank layout]
Ranks are numbered with tp innermost, so a TP group is always consecutive ranks inside one node.
`rank_order` says which of dp and pp comes next: with "tp-dp-pp" (default) the DP replicas of a
stage are neighbours and pipeline neighbours are dp*tp ranks apart; with "tp-pp-dp" pipeline
neighbours share a node when tp*pp fits in one. rank = tp_index + tp * (i1 + n1 * i2) where
(i1, n1) is the middle axis and i2 the outer one.

[Note: expert layout]
Which ranks exchange tokens with which (the ep group), which slice of the experts a rank holds (its
ep index) and which ranks hold the same slice (the expert-data-parallel group), on each pipeline rank.
Under expert tp 1 (the default):
ep divides tp x dp (Megatron-Core's EP x ETP x EDP = TP x DP with expert tp 1), so it may exceed dp:
tp 2 x dp 2 at ep 4 gives each of the 4 ranks a quarter of the experts. dp counts the cp ranks, whose
chunks of a sequence are tokens of their own to the experts, so the groups fold over them too. Under
HSDP ep divides tp x dp_shard, so each replica group holds every expert once and the ranks holding
the same experts are a (dp_replicate, tp x dp_shard / ep) grid: FSDP shards the experts along the
second axis and replicates them along the first, as it does the other parameters (torchtitan's
expert parallelism borrows from dp_shard, never from dp_replicate).
With expert tp 1 under tp > 1 (`Plan.expert_token_split` = tp) every tp rank brings its own tokens to
the experts, so a mixture-of-experts layer sees tp * dp ranks of distinct tokens: positions
j = dp_index * tp + tp_index, tp fastest as ranks are numbered. The ep groups are ep consecutive
positions (consecutive ranks under "tp-dp-pp", one node whenever ep GPUs fit one; under "tp-pp-dp"
with pp > 1 the positions of one pipeline rank are tp x pp ranks apart), a rank's ep index is j mod ep and
the ranks holding its experts (over which their gradients are summed and ZeRO or FSDP shards them)
are the positions with the same j mod ep: Megatron-Core's "MoE parallel folding" (EP x ETP taken
over TP x DP, Megatron-Core MoE README; Liu et al. 2025, "MoE Parallel Folding", arXiv:2504.14960).
At tp 1 the positions are the dp replicas.
Under expert tp etp = tp (`Plan.expert_tp`) the tp ranks of a replica share its tokens and split each
expert's hidden units, so the positions are the dp replicas (width tp / etp = 1 per replica), ep
divides dp, and each tp index forms its own ep groups and expert-data-parallel groups: a rank's ep
group is the ep consecutive replicas at its tp index, and the ranks holding its slice are those with
the same ep index and tp index (Megatron-Core's expert rank order etp-ep-edp, parallel_state.py
`RankGenerator` for experts). In general position j = dp_index * tp / etp + tp_index // etp and the
expert-tp index tp_index mod etp (`expert_slot`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplan._files import read_json
from autoplan.layout import LAYOUT_FIELDS, RANK_ORDERS, LayoutCounts, carries_layout, layout_rank

__all__ = [
    "MAX_MICROBATCHES",
    "PLAN_SCHEMA_VERSION",
    "RANK_ORDERS",
    "REDUCE_DTYPES",
    "RECOMPUTE",
    "BREAKDOWN_TERMS",
    "BreakdownTerm",
    "ExpertSlot",
    "Job",
    "MemoryBreakdown",
    "Plan",
    "PlanError",
    "Predicted",
    "StagePlan",
    "expert_layout_refusal",
    "expert_positions",
    "expert_slot",
    "layout_rank",
    "reduce_dtype_refusal",
    "validate",
]

PLAN_SCHEMA_VERSION = 2
"""2 added the model's recorded source (`model_digest`, `leaf_modules`, `tracer`); version 1 plans
are still read (those fields take their defaults)."""
READABLE_SCHEMA_VERSIONS = (1, 2)
RECOMPUTE = ("none", "selective", "full")
# RANK_ORDERS and layout_rank live with the layout (layout.py); plan.py names them as before.


@dataclass(frozen=True)
class ExpertSlot:
    """Where one rank sits in the expert layout of one pipeline rank ([Note: expert layout])."""

    group: int
    """Its ep group (ranks with the same value exchange tokens)."""
    index: int
    """Its place in that group: which E / ep experts it holds."""
    etp_index: int = 0
    """Which 1 / expert tp of those experts' hidden units it holds (0 under expert tp 1)."""
    etp: int = 1

    @property
    def holding(self) -> int:
        """Ranks with the same value hold the same slice of the same experts: its expert-data-parallel
        group."""
        return self.index * self.etp + self.etp_index


def expert_slot(ep: int, tp: int, dp_index: int, tp_index: int, etp: int = 1) -> ExpertSlot:
    """The expert layout of the rank at (dp_index, tp_index) under expert tp `etp`; see [Note:
    expert layout]."""
    position = dp_index * (tp // etp) + tp_index // etp
    etp_index = tp_index % etp
    return ExpertSlot(group=(position // ep) * etp + etp_index, index=position % ep, etp_index=etp_index, etp=etp)


def expert_positions(ep: int, tp: int, dp: int, first: int, etp: int = 1, etp_index: int = 0) -> list[tuple[int, int]]:
    """(dp index, tp index) of the positions first, first + ep, ... < tp / etp x dp at expert-tp index
    `etp_index`: with first < ep the ranks holding that slice of the experts of ep index `first`
    ([Note: expert layout])."""
    width = tp // etp
    return [(j // width, (j % width) * etp + etp_index) for j in range(first, width * dp, ep)]


def expert_layout_refusal(ep: int, tp: int, dp: int, dp_replicate: int = 1, etp: int = 1) -> str | None:
    """Why ep and expert tp `etp` cannot lay the experts out over tp x dp (one line), or None ([Note:
    expert layout])."""
    if not isinstance(etp, int) or isinstance(etp, bool) or etp not in {1, tp}:
        return f"expert tp {etp!r} must be 1 or the attention's tp {tp} (the degrees built)"
    width = tp // etp
    if (width * dp) % ep:
        over = f"tp x dp = {tp * dp}" if etp == 1 else f"dp = {dp} under expert tp {etp}"
        return f"ep {ep} must divide {over} (the ranks the experts are split over)"
    if dp_replicate > 1 and (width * (dp // dp_replicate)) % ep:
        over = "tp x dp_shard" if etp == 1 else "dp_shard"
        return (f"ep {ep} must divide {over} = {width * (dp // dp_replicate)} under HSDP (dp_replicate "
                f"{dp_replicate}: each replica group holds every expert)")
    return None


REDUCE_DTYPES = ("float32", "bfloat16")
"""Dtypes FSDP may reduce gradients in (`Plan.reduce_dtype`)."""


def reduce_dtype_refusal(reduce_dtype: str, zero: int, job_dtype: str) -> str | None:
    """Why gradients cannot be reduced in `reduce_dtype` (one line), or None. bfloat16 reduction is
    FSDP's `MixedPrecisionPolicy(reduce_dtype=bfloat16)`: zero 0 / 1 reduce the fp32 gradients of
    precision.py's masters, and a float16 or float32 job computes its gradients in another dtype."""
    if reduce_dtype not in REDUCE_DTYPES:
        return f"reduce_dtype {reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}"
    if reduce_dtype == "bfloat16" and zero < 2:
        return (f"reduce_dtype bfloat16 needs FSDP (zero 2 or 3), not zero {zero}: zero 0 and 1 reduce fp32 "
                "gradients")
    if reduce_dtype == "bfloat16" and job_dtype != "bfloat16":
        return f"reduce_dtype bfloat16 needs a bfloat16 job, not {job_dtype}"
    return None


class PlanError(ValueError):
    """A plan file or object that cannot be used as it is."""


JOB_DTYPES = ("bfloat16", "float16", "float32")
"""Compute dtypes a plan may name (mixed precision with fp32 optimizer state, or fp32 throughout)."""
MAX_JOB_SIZE = 2**31
"""Largest global batch or sequence length a plan may carry: far above any run (Llama 3 405B: 16M
tokens per step, arXiv:2407.21783), low enough that nothing downstream overflows."""


@dataclass(frozen=True, kw_only=True)
class Job:
    global_batch: int
    """Sequences per optimizer step, over all data-parallel replicas."""
    seq_len: int
    dtype: str = "bfloat16"
    """Compute dtype (weights and activations); optimizer state is fp32 (mixed precision)."""


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one GPU at its peak. See cost/memory.py for each term's source."""

    weights_bytes: float = 0.0
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    activations_bytes: float = 0.0
    buffers_bytes: float = 0.0
    """P2P receive buffers and the backward's transient working set."""
    allowance_bytes: float = 0.0
    """CUDA context, NCCL buffers and allocator fragmentation."""
    gathered_bytes: float = 0.0
    """FSDP (zero >= 2) during a step: unsharded parameters and unsharded accumulated gradients in
    flight (cost/memory.py [Note: FSDP gathered bytes]); weights + grads + optimizer are what is
    kept between steps."""

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buffers_bytes + self.allowance_bytes + self.gathered_bytes)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    """Virtual stage index, 0 .. pp*virtual_stages - 1; it runs on pipeline rank index % pp."""
    pp_rank: int
    first_block: int
    end_block: int
    """Exclusive: the stage holds blocks first_block .. end_block - 1."""
    first_block_name: str = ""
    last_block_name: str = ""
    fwd_time_s: float = 0.0
    """Predicted forward time of one micro-batch (TP communication included)."""
    bwd_time_s: float = 0.0
    """Predicted backward time of one micro-batch (recompute included)."""
    num_params: int = 0
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    """Memory of the GPU this stage runs on (all its virtual stages), at its peak."""


class BreakdownTerm:
    """The causes `Predicted.breakdown` splits a step's seconds into, one name each: the cost side writes
    them (search/assemble.py), the search's explanations (search/space.py) and the pictures
    (report/timeline/predicted.py) read them. Plain strings: the keys a plan file holds."""

    COMPUTE = "compute_s"
    """Forward and backward of every block, recompute included, communication left out."""
    TP_COMM = "tp_comm_s"
    """Tensor-parallel collectives inside the blocks (sequence parallelism's too)."""
    EP_COMM = "ep_comm_s"
    """Expert parallelism's all-to-alls and expert tp's collectives (present when a rank holds expert slices)."""
    CP_COMM = "cp_comm_s"
    """Context parallelism's key/value all-gathers (present with cp > 1)."""
    BUBBLE = "bubble_s"
    """Pipeline idle time between the ranks' work."""
    TIED_GRAD_SYNC = "tied_grad_sync_s"
    """The sum of a tied embedding's and head's gradients over the first and last pipeline ranks."""
    DP_COMM_EXPOSED = "dp_comm_exposed_s"
    """Data-parallel gradient reduction not hidden behind the backward."""
    OPTIMIZER = "optimizer_s"
    """The optimizer step."""
    FSDP_COMM_EXPOSED = "fsdp_comm_exposed_s"
    """FSDP's all-gathers and reduce-scatters not hidden behind the passes (present with zero >= 2)."""


BREAKDOWN_TERMS = (BreakdownTerm.COMPUTE, BreakdownTerm.TP_COMM, BreakdownTerm.EP_COMM, BreakdownTerm.CP_COMM,
                   BreakdownTerm.BUBBLE, BreakdownTerm.TIED_GRAD_SYNC, BreakdownTerm.DP_COMM_EXPOSED,
                   BreakdownTerm.OPTIMIZER, BreakdownTerm.FSDP_COMM_EXPOSED)
"""Every `BreakdownTerm`, in the order a plan writes them."""


@dataclass(frozen=True, kw_only=True)
class Predicted:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    """Model FLOPs (forward + backward, no recompute) per second per GPU, in TFLOP/s."""
    hardware_tflops_per_gpu: float
    """Hardware FLOPs (recompute included) per second per GPU, in TFLOP/s."""
    mfu: float
    """Model FLOPs utilization: model TFLOP/s over the GPU's dense peak (Chowdhery et al. 2022, App. B)."""
    hfu: float
    """Hardware FLOPs utilization: hardware TFLOP/s over peak."""
    peak_memory_bytes: float
    bubble_fraction: float
    bound: str = ""
    """One line on what limits the plan: bubble, a slow stage, DP communication, memory."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by cause, keyed by `BreakdownTerm` (`BREAKDOWN_TERMS`)."""


@dataclass(frozen=True, kw_only=True)
@carries_layout  # a Layout field not declared below, with its default (layout.py)
class Plan(LayoutCounts):
    model: str
    """The model spec it was made for (zoo spec, file:function, or a class name for API models)."""
    model_fingerprint: str
    cluster: dict[str, Any]
    """`Cluster.to_dict()`; `plan.cluster_obj()` rebuilds it."""
    job: Job
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    recompute: str
    zero: int
    sequence_parallel: bool
    rank_order: str
    stages: tuple[StagePlan, ...]
    block_names: tuple[str, ...]
    fits: bool
    predicted: Predicted
    schema_version: int = PLAN_SCHEMA_VERSION
    notes: tuple[str, ...] = ()
    model_digest: str = ""
    """sha256 of the file the model comes from (a model file, a Hugging Face config.json), else empty."""
    leaf_modules: tuple[str, ...] = ()
    """`--leaf-modules` the model was traced with: the runtime traces it the same way."""
    tracer: str = "auto"
    """`--tracer` the model was traced with (auto, fx, export or modules)."""
    dp_replicate: int = 1
    """HSDP (zero >= 2): the dp replicas form dp_replicate groups of dp_shard = dp / dp_replicate;
    FSDP shards over a group and replicates across groups (torchtitan's
    `data_parallel_replicate_degree`). 1: plain FSDP (or DDP-style for zero 0 / 1)."""
    cp: int = 1
    """Context parallelism: groups of cp consecutive dp ranks split every sequence into 2 * cp
    load-balanced chunks and all-gather keys and values in attention (runtime/parallel/context.py). dp counts
    them: dp / cp replicas take distinct batches (torchtitan's dp_shard x cp); gradients are averaged
    over all dp ranks."""
    ep: int = 1
    """Expert parallelism: groups of ep ranks split each mixture-of-experts layer's experts ep ways
    and send tokens to them by all-to-all (runtime/parallel/experts.py): ep consecutive positions over tp x dp
    under expert tp 1 with tp > 1, else ep consecutive dp replicas ([Note: expert layout]). 1: every
    replica holds every expert."""
    expert_tp: int = 1
    """Expert tensor parallelism: how many ranks of a tp group split each expert's hidden units, 1 or
    tp (Megatron-LM's `--expert-tensor-parallel-size`; torchtitan 0.3.0 has no such degree).
    1 (the default, as Megatron-LM's published MoE runs use): every expert is whole on the rank that
    holds it, and under attention tp > 1 each tp rank sends its own 1 / tp of the tokens to the
    experts. tp: the tp ranks of a replica hold the same experts, each 1 / tp of every expert's
    hidden units (a column-parallel up and a row-parallel down projection, Shoeybi et al. 2019), run
    them on all of the replica's tokens and sum their outputs over tp ([Note: expert tp] in
    runtime/parallel/expert_tp.py)."""
    reduce_dtype: str = "float32"
    """The dtype FSDP (zero >= 2) reduces gradients in (`MixedPrecisionPolicy.reduce_dtype`,
    runtime/parallel/fsdp.py): float32, or bfloat16 for a bfloat16 job (half the reduce-scatter's bytes;
    Megatron-LM's `--grad-reduce-in-bf16`; torchtitan 0.3.0 reduces in fp32 only)."""

    # ---- derived -----------------------------------------------------------------------------
    # num_gpus, num_stages, replicas, dp_shard, expert_token_split, rank and coords: LayoutCounts
    # (layout.py), from the layout fields above.
    def expert_slot(self, dp_index: int, tp_index: int) -> ExpertSlot:
        """The rank at (dp_index, tp_index)'s place in the expert layout ([Note: expert layout])."""
        return expert_slot(self.ep, self.tp, dp_index, tp_index, self.expert_tp)

    @property
    def boundaries(self) -> tuple[int, ...]:
        return (0, *(s.end_block for s in self.stages))

    @property
    def run_fingerprint(self) -> str:
        """16 hex digits of sha256 over what a run of the plan does: the model (spec, structural
        fingerprint, file digest), the cluster, the job, every degree, the schedule, the micro-batches
        and the stage cuts. Predictions are left out: re-planning the same layout with another
        calibration keeps the fingerprint, so its traces still compare (`autoplan run --trace`
        records it; `autoplan show --trace` compares it)."""
        import hashlib

        identity = {
            "model": [self.model, self.model_fingerprint, self.model_digest],
            "cluster": self.cluster,
            "job": [self.job.global_batch, self.job.seq_len, self.job.dtype],
            # Choices added after the first plans (reduce dtype, and each layout field not in
            # layout.FIRST_RECORDED, expert tp the first) enter only away from their default, so plans
            # and traces recorded before them keep their fingerprints; a field added to `Layout`
            # enters by itself (tests/test_layout.py).
            "layout": [self.tp, self.pp, self.dp, self.cp, self.ep, self.zero, self.dp_replicate, self.rank_order,
                       self.sequence_parallel, self.recompute, *([self.reduce_dtype] if self.reduce_dtype != "float32" else []),
                       *(f"{name}={value}" for name, value in self.later_fields().items())],
            "schedule": [self.schedule, self.virtual_stages, self.micro_batch_size, self.num_microbatches],
            "cuts": list(self.boundaries),
        }
        text = json.dumps(identity, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def cluster_obj(self):
        from autoplan.cluster import Cluster

        return Cluster.from_dict(self.cluster, where="plan.cluster")

    def stages_of_pp_rank(self, pp_index: int) -> list[StagePlan]:
        return [s for s in self.stages if s.pp_rank == pp_index]

    # ---- (de)serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (a crash never leaves half a plan where a good one was)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        tmp.replace(path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan `data` describes (`to_dict`'s form), every field checked: types, ranges and names
        (`_typed`), then the plan's own consistency (`validate`); PlanError names the first problem."""
        plan = cls._from_dict_unchecked(data)
        problems = validate(plan)
        if problems:
            raise PlanError(f"the plan is inconsistent: {problems[0]}; re-create it with `autoplan suggest --out`")
        return plan

    @classmethod
    def _from_dict_unchecked(cls, data: Mapping[str, Any]) -> Plan:
        """`data` as a Plan, each field of the type its annotation names; not yet `validate`d."""
        if not isinstance(data, Mapping):
            raise PlanError("a plan must be a JSON object")
        version = data.get("schema_version")
        if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # True == 1 and 2.0 == 2 are not versions
            if version is None and isinstance(data.get("plans"), list):
                raise PlanError(_SUGGEST_JSON_HINT)
            raise PlanError(f"plan schema version {version!r} is not supported (this autoplan reads versions "
                            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}); re-create the plan with `autoplan suggest`")
        d = _typed(cls, data, "plan", nested={"job", "predicted", "stages", "cluster"})
        d["job"] = Job(**_typed(Job, d["job"], "plan.job"))
        d["predicted"] = Predicted(**_typed(Predicted, d["predicted"], "plan.predicted"))
        if not isinstance(d["stages"], (list, tuple)):
            raise PlanError("plan.stages must be a list of stages")
        stages = []
        for i, raw in enumerate(d["stages"]):
            if isinstance(raw, Mapping) and "memory" not in raw:  # to_dict always writes it; its default is for Python
                raise PlanError(f"plan.stages[{i}] is missing field 'memory'; re-create the plan with "
                                "`autoplan suggest --out`")
            stage = _typed(StagePlan, raw, f"plan.stages[{i}]", nested={"memory"})
            stage["memory"] = MemoryBreakdown(**_typed(MemoryBreakdown, stage["memory"], f"plan.stages[{i}].memory"))
            stages.append(StagePlan(**stage))
        d["stages"] = tuple(stages)
        d["block_names"] = tuple(d["block_names"])
        d["notes"] = tuple(d.get("notes", ()))
        d["leaf_modules"] = tuple(d.get("leaf_modules", ()))
        return cls(**d)

    @classmethod
    def load(cls, path: str | os.PathLike, *, plan_index: int | None = None) -> Plan:
        """The plan in the JSON file at `path`: one written by `autoplan suggest --out` (or `save`), or
        one of the plans of `autoplan suggest --json` output (`plan_index`, default 0: the best).
        PlanError (one line) for a file that is not a usable plan."""
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"a plan is loaded from a path (a plan JSON file), got {type(path).__name__}")
        if plan_index is not None and (type(plan_index) is not int or plan_index < 0):
            raise PlanError(f"--plan-index {plan_index!r} must be an integer, 0 or more")
        data = read_json(path, "plan file", PlanError, f"create one with `autoplan suggest --out {str(path)!r}`")
        data = _one_plan(data, str(path), plan_index)
        plan = cls._from_dict_unchecked(data)
        problems = validate(plan)
        if problems:
            raise PlanError(f"plan file {str(path)!r} is inconsistent: {problems[0]}; re-create it with "
                            f"`autoplan suggest ... --out {str(path)!r}`")
        return plan


_SUGGEST_JSON_HINT = ("this is `autoplan suggest --json` output, not a plan: take one of its `plans`, or write a plan "
                      "with `autoplan suggest ... --out p.json`")


def _one_plan(data: Any, path: str, plan_index: int | None) -> Any:
    """The plan dict in a plan file's JSON: the file itself, or `plans[plan_index]` (default 0) of
    `autoplan suggest --json` output ({"plans": [...], "search": {...}}). A list (`suggest
    --sweep-gpus --json`) is refused in one line."""
    if isinstance(data, list) and data and all(isinstance(row, Mapping) and "num_gpus" in row for row in data):
        raise PlanError(f"plan file {path!r} is `autoplan suggest --sweep-gpus --json` output (one row per GPU count), "
                        "not a plan; write one with `autoplan suggest --cluster NODESxGPUSxGPU ... --out p.json`")
    suggest_json = isinstance(data, Mapping) and "schema_version" not in data and isinstance(data.get("plans"), list)
    if not suggest_json:
        if plan_index not in (None, 0):
            raise PlanError(f"--plan-index {plan_index} picks one of the plans of `autoplan suggest --json` output, but "
                            f"{path!r} holds one plan; drop --plan-index")
        return data
    plans = data["plans"]
    index = 0 if plan_index is None else plan_index
    if not plans:
        raise PlanError(f"plan file {path!r} is `autoplan suggest --json` output with no plans; write a plan with "
                        "`autoplan suggest ... --out p.json`")
    if index >= len(plans):
        raise PlanError(f"--plan-index {index} is past the {len(plans)} plan{'s' if len(plans) > 1 else ''} of "
                        f"`autoplan suggest --json` output {path!r}; use 0 to {len(plans) - 1}")
    return plans[index]


_SCALARS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _typed(cls: type, raw: Any, where: str, nested: set[str] = frozenset()) -> dict[str, Any]:
    """`raw` as keyword arguments for dataclass `cls`, each field checked against its annotation
    (`int`, `float`, `str`, `bool`, `X | None`, tuples and dicts); PlanError names the first bad one.
    Fields in `nested` are only checked for presence (the caller builds them)."""
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where} must be a JSON object, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise PlanError(f"{where} is missing field {f.name!r}")
        value = raw[f.name]
        out[f.name] = value
        if f.name in nested:
            continue
        annotation = str(f.type).replace(" ", "")
        optional = annotation.endswith("|None")
        base = annotation.removesuffix("|None")
        if value is None and optional:
            continue
        if base in _SCALARS:
            ok = isinstance(value, _SCALARS[base]) and (base == "bool" or not isinstance(value, bool))
            ok = ok and not (base == "float" and isinstance(value, float) and value != value)  # NaN
        elif base.startswith("tuple["):
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        elif base.startswith("dict["):
            ok = isinstance(value, Mapping) and (
                not base.startswith("dict[str,float]")
                or all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()))
        else:
            ok = True
        if not ok:
            raise PlanError(f"{where}.{f.name} = {value!r} is not a valid {base}; re-create the plan with "
                            "`autoplan suggest --out`")
    unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise PlanError(f"{where} has an unknown field {sorted(unknown)[0]!r}")
    return out


def validate(plan: Plan) -> list[str]:
    """Every inconsistency in a plan, as one-line messages ([] when it is consistent)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"validate takes a Plan (autoplan.suggest or Plan.load), got {type(plan).__name__}")
    problems: list[str] = []
    try:
        cluster = plan.cluster_obj()
    except (ValueError, TypeError) as exc:  # TypeError: a curve point that is not a number (float([]))
        return [f"plan.cluster is malformed: {(str(exc).splitlines() or [type(exc).__name__])[0]}"]
    num_gpus, gpus_per_node = cluster.num_gpus, cluster.gpus_per_node
    problems += _check_types(plan)
    if problems:
        return problems
    # Every loop below, and every one `show`, `export` and `run` make, is bounded by the plan's own
    # sizes: pp by the GPU count, stages by the blocks listed, micro-batches by the global batch and
    # MAX_MICROBATCHES. Each bound is checked before anything is built on it (a plan with 10^12
    # micro-batches built a schedule for minutes, issue 43).
    if plan.tp * plan.pp * plan.dp != num_gpus:
        problems.append(f"tp*pp*dp = {plan.tp}*{plan.pp}*{plan.dp} = {plan.tp * plan.pp * plan.dp} "
                        f"but the cluster has {num_gpus} GPUs")
    if gpus_per_node % plan.tp != 0:
        problems.append(f"tp = {plan.tp} does not divide the {gpus_per_node} GPUs of a node, so a TP group would span nodes")
    if plan.cp < 1 or plan.dp % plan.cp:
        problems.append(f"cp = {plan.cp!r} must be a positive integer dividing dp = {plan.dp} (sequences are split "
                        "over data-parallel ranks)")
        return problems
    if plan.micro_batch_size * plan.num_microbatches * plan.replicas != plan.job.global_batch:
        problems.append(f"micro_batch_size*num_microbatches*(dp/cp) = {plan.micro_batch_size}*{plan.num_microbatches}*"
                        f"{plan.replicas} != global batch {plan.job.global_batch}")
    if plan.num_microbatches > MAX_MICROBATCHES:
        problems.append(f"num_microbatches = {plan.num_microbatches:,} is more than the {MAX_MICROBATCHES:,} a plan may "
                        "hold (MAX_MICROBATCHES); a larger micro_batch_size or more replicas")
    if plan.cp > 1 and plan.job.seq_len % (2 * plan.cp):
        problems.append(f"seq_len {plan.job.seq_len} is not divisible by 2 * cp = {2 * plan.cp} (each rank holds two "
                        "chunks of every sequence)")
    if plan.sequence_parallel and plan.tp == 1:  # it splits the tp group's activations (search/configs.py)
        problems.append("sequence_parallel needs tp of at least 2, not tp 1")
    if plan.recompute not in RECOMPUTE:
        problems.append(f"recompute {plan.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if plan.zero not in (0, 1, 2, 3):
        problems.append(f"zero {plan.zero!r} must be 0, 1, 2 or 3")
    if not isinstance(plan.dp_replicate, int) or plan.dp_replicate < 1 or plan.dp % plan.dp_replicate:
        problems.append(f"dp_replicate = {plan.dp_replicate!r} must be a positive integer dividing dp = {plan.dp}")
    elif plan.dp_replicate > 1 and plan.zero < 2:
        problems.append(f"dp_replicate = {plan.dp_replicate} (HSDP) needs zero 2 or 3 (FSDP), not zero {plan.zero}")
    if not isinstance(plan.ep, int) or isinstance(plan.ep, bool) or plan.ep < 1:
        problems.append(f"ep = {plan.ep!r} must be a positive integer")
    elif expert_layout_refusal(plan.ep, plan.tp, plan.dp, plan.dp_replicate, plan.expert_tp) is not None:
        problems.append(f"{expert_layout_refusal(plan.ep, plan.tp, plan.dp, plan.dp_replicate, plan.expert_tp)}; "
                        "re-plan with `autoplan suggest`")
    if reduce_dtype_refusal(plan.reduce_dtype, plan.zero, plan.job.dtype) is not None:
        problems.append(f"{reduce_dtype_refusal(plan.reduce_dtype, plan.zero, plan.job.dtype)}; re-plan with "
                        "`autoplan suggest`")
    if plan.tracer not in ("auto", "fx", "export", "modules"):
        problems.append(f"tracer {plan.tracer!r} is not one of auto, fx, export, modules")
    if plan.rank_order not in RANK_ORDERS:
        problems.append(f"rank_order {plan.rank_order!r} is not one of {', '.join(RANK_ORDERS)}")
    if len(plan.stages) != plan.num_stages:
        problems.append(f"{len(plan.stages)} stages listed but pp*virtual_stages = {plan.num_stages}")
        return problems  # virtual_stages is bounded by the stages listed: nothing is built on it before
    from autoplan.schedule import SCHEDULES, make_schedule

    if plan.schedule not in SCHEDULES:
        problems.append(f"schedule {plan.schedule!r} is not one of {', '.join(SCHEDULES)}")
    elif not problems:  # only on sizes checked above (micro-batches, stages): a schedule is O(their product)
        try:  # the schedule's own rules (virtual stages, micro-batches per rank): what show and run build
            make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
        except ValueError as exc:
            problems.append(f"schedule {plan.schedule!r} with pp {plan.pp}, {plan.num_microbatches} micro-batches and "
                            f"virtual_stages {plan.virtual_stages}: {str(exc).splitlines()[0]}")
    expected_start = 0
    for i, stage in enumerate(plan.stages):
        if stage.index != i or stage.pp_rank != i % plan.pp:
            problems.append(f"stage {i} has index {stage.index} and pp_rank {stage.pp_rank}; expected {i} and {i % plan.pp}")
        if stage.first_block != expected_start:
            problems.append(f"stage {i} starts at block {stage.first_block}, expected {expected_start}: blocks must be "
                            "placed in order, each once")
        if stage.end_block <= stage.first_block:
            problems.append(f"stage {i} is empty (blocks {stage.first_block}..{stage.end_block})")
        elif stage.end_block <= len(plan.block_names):  # names are optional (a plan built by hand leaves them "")
            for label, name, at in (("first", stage.first_block_name, stage.first_block),
                                    ("last", stage.last_block_name, stage.end_block - 1)):
                if name and at >= 0 and plan.block_names[at] != name:
                    problems.append(f"stage {i}'s {label} block is named {name!r} but block {at} is "
                                    f"{plan.block_names[at]!r}")
        expected_start = stage.end_block
    if plan.stages and expected_start != len(plan.block_names):
        problems.append(f"stages cover {expected_start} blocks but the model has {len(plan.block_names)}")
    problems += _check_numbers(plan)
    if plan.fits:
        capacity = min(gpu.mem_bytes for gpu in cluster.gpu_types)
        for stage in plan.stages:
            if stage.memory.total_bytes > capacity * (1 + 1e-9):
                problems.append(f"stage {stage.index} needs {stage.memory.total_bytes / 2**30:.2f} GiB but the GPU has "
                                f"{capacity / 2**30:.2f} GiB, yet the plan says it fits")
    return problems


MAX_MICROBATCHES = 4096
"""Most micro-batches per replica a plan may hold: schedules are lists of O(micro-batches x stages)
actions that `show`, `export` and `run` build, and real runs use far fewer (Megatron-LM's published
runs: <= 512). The search considers no more (search/configs.py)."""
_INT_FIELDS = ("tp", "pp", "dp", "virtual_stages", "micro_batch_size", "num_microbatches")
"""Degrees and sizes: positive integers (each one's relation to the others is checked in `validate`)."""
_OTHER_DEGREES = tuple(name for name in LAYOUT_FIELDS if name not in _INT_FIELDS and name != "rank_order")
"""Integers whose range `validate` checks against the degrees they divide: every other layout field
but the rank order (cp, ep, expert tp, dp replicate), so a degree added to `Layout` is type-checked."""


def _check_types(plan: Plan) -> list[str]:
    """Fields of the wrong type or out of their own range, before any is combined with another (a
    Plan built in Python skips `from_dict`'s type checks; bools are not integers here)."""
    problems = []
    if type(plan.schema_version) is not int or plan.schema_version not in READABLE_SCHEMA_VERSIONS:
        problems.append(f"schema_version {plan.schema_version!r} is not one of "
                        f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
    for name in _INT_FIELDS:
        value = getattr(plan, name)
        if type(value) is not int or value < 1:
            problems.append(f"{name} = {value!r} must be a positive integer")
    for name in _OTHER_DEGREES:
        if type(getattr(plan, name)) is not int:
            problems.append(f"{name} = {getattr(plan, name)!r} must be a positive integer")
    if type(plan.zero) is not int:
        problems.append(f"zero {plan.zero!r} must be 0, 1, 2 or 3")
    for name in ("sequence_parallel", "fits"):
        if not isinstance(getattr(plan, name), bool):
            problems.append(f"{name} = {getattr(plan, name)!r} must be true or false")
    for name in ("model", "model_fingerprint", "schedule", "recompute", "rank_order", "reduce_dtype", "tracer"):
        if not isinstance(getattr(plan, name), str):
            problems.append(f"{name} = {getattr(plan, name)!r} must be a string")
    if not isinstance(plan.model, str) or not plan.model.strip():
        problems.append("model is empty: a plan names the model it was made for")
    job = plan.job
    for name, value in (("job.global_batch", job.global_batch), ("job.seq_len", job.seq_len)):
        if type(value) is not int or not 1 <= value <= MAX_JOB_SIZE:
            problems.append(f"{name} = {value!r} must be an integer from 1 to {MAX_JOB_SIZE:,}")
    if job.dtype not in JOB_DTYPES:
        problems.append(f"job.dtype {job.dtype!r} is not one of {', '.join(JOB_DTYPES)}")
    if not isinstance(plan.stages, tuple | list) or not all(isinstance(s, StagePlan) for s in plan.stages):
        problems.append("stages must be a list of stages")
    else:
        for stage in plan.stages:
            for name in ("index", "pp_rank", "first_block", "end_block"):
                if type(getattr(stage, name)) is not int:
                    problems.append(f"stages[...].{name} = {getattr(stage, name)!r} must be an integer")
    if not isinstance(plan.block_names, tuple | list) or not all(isinstance(b, str) for b in plan.block_names):
        problems.append("block_names must be a list of strings")
    return problems


_RELATIVE_TOLERANCE = 1e-6
"""How far a derived figure may differ from what it is derived from (float rounding in JSON)."""


def _bad_number(value: Any) -> bool:
    """Not a finite number at least 0 (sizes, times, rates and fractions are never negative)."""
    return isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0


_PREDICTED_FIGURES = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "hfu",
                      "peak_memory_bytes", "bubble_fraction")


def _check_numbers(plan: Plan) -> list[str]:
    """The prediction's figures and each stage's times, sizes and bytes: finite and not negative;
    and what the search derives from them agrees (tokens per second from the step time and the job,
    the peak memory from the stages'). A plan built by hand may carry no prediction (all zeros)."""
    problems: list[str] = []
    predicted = plan.predicted
    for name in _PREDICTED_FIGURES:
        value = getattr(predicted, name)
        if _bad_number(value):
            problems.append(f"predicted.{name} = {value!r} must be a finite number, 0 or more")
    for name, value in predicted.breakdown.items():
        # Seconds by cause, each a difference of sums: float rounding may leave -1e-21 where 0 is meant.
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or \
                value < -1e-9 * max(1.0, abs(predicted.step_time_s) if math.isfinite(predicted.step_time_s) else 1.0):
            problems.append(f"predicted.breakdown[{name!r}] = {value!r} must be a finite number of seconds, 0 or more")
    if not problems:
        # Shares of the step and of the GPU's peak (PaLM's MFU, Chowdhery et al. 2022, App. B): a bubble
        # is idle time between work, never the whole step; no GPU runs above its peak.
        for name in ("mfu", "hfu"):
            if getattr(predicted, name) > 1:
                problems.append(f"predicted.{name} = {getattr(predicted, name)!r} must be at most 1 (a share of the "
                                "GPU's peak)")
        if predicted.bubble_fraction >= 1:
            problems.append(f"predicted.bubble_fraction = {predicted.bubble_fraction!r} must be below 1 (a share of "
                            "the step)")
    for stage in plan.stages:
        where = f"stages[{stage.index}]"
        for name in ("fwd_time_s", "bwd_time_s", "num_params"):
            if _bad_number(getattr(stage, name)):
                problems.append(f"{where}.{name} = {getattr(stage, name)!r} must be a finite number, 0 or more")
        for f in dataclasses.fields(MemoryBreakdown):
            value = getattr(stage.memory, f.name)
            if _bad_number(value):
                problems.append(f"{where}.memory.{f.name} = {value!r} must be a finite number of bytes, 0 or more")
    if problems:
        return problems
    if predicted.step_time_s == 0:
        # No prediction (a plan built by hand) is all zeros; a step that takes no time is not a prediction.
        figures = [name for name in _PREDICTED_FIGURES if name != "step_time_s" and getattr(predicted, name)]
        if figures or any(predicted.breakdown.values()):
            problems.append(f"predicted.step_time_s = 0 but the plan predicts {(figures or ['a breakdown'])[0]}: a "
                            "predicted step takes time (the prediction was edited)")
        return problems
    # MFU and HFU share one peak (model or hardware TFLOP/s over it), and the hardware's FLOPs include
    # the model's (recompute adds to them).
    if predicted.model_tflops_per_gpu > predicted.hardware_tflops_per_gpu * (1 + _RELATIVE_TOLERANCE):
        problems.append(f"predicted.model_tflops_per_gpu = {predicted.model_tflops_per_gpu:.6g} is above "
                        f"hardware_tflops_per_gpu = {predicted.hardware_tflops_per_gpu:.6g} (recompute only adds FLOPs)")
    elif predicted.mfu and predicted.hfu and not math.isclose(
            predicted.model_tflops_per_gpu * predicted.hfu, predicted.hardware_tflops_per_gpu * predicted.mfu,
            rel_tol=_RELATIVE_TOLERANCE):
        problems.append(f"predicted.mfu = {predicted.mfu:.6g} and hfu = {predicted.hfu:.6g} do not share a peak with "
                        f"model and hardware TFLOP/s {predicted.model_tflops_per_gpu:.6g} and "
                        f"{predicted.hardware_tflops_per_gpu:.6g} (the prediction was edited)")
    # Parts of one step: each cause's seconds, and one micro-batch's forward and backward of one stage
    # (the step runs every stage's at least once).
    step_s = predicted.step_time_s * (1 + _RELATIVE_TOLERANCE)
    for name, value in predicted.breakdown.items():
        if value > step_s:
            problems.append(f"predicted.breakdown[{name!r}] = {value:.6g} s is longer than the step "
                            f"({predicted.step_time_s:.6g} s)")
    for stage in plan.stages:
        if stage.fwd_time_s + stage.bwd_time_s > step_s:
            problems.append(f"stages[{stage.index}] forward + backward = {stage.fwd_time_s + stage.bwd_time_s:.6g} s "
                            f"is longer than the step ({predicted.step_time_s:.6g} s)")
    tokens = plan.job.global_batch * plan.job.seq_len
    expected = tokens / predicted.step_time_s
    if not math.isclose(predicted.tokens_per_s, expected, rel_tol=_RELATIVE_TOLERANCE):
        problems.append(f"job.global_batch x job.seq_len = {plan.job.global_batch:,} x {plan.job.seq_len:,} tokens "
                        f"per step, but the prediction was made for {predicted.tokens_per_s * predicted.step_time_s:,.0f}"
                        " (predicted.tokens_per_s x step_time_s): the job or the prediction was edited")
    peak = max((stage.memory.total_bytes for stage in plan.stages), default=0.0)
    if not math.isclose(predicted.peak_memory_bytes, peak, rel_tol=_RELATIVE_TOLERANCE):
        problems.append(f"predicted.peak_memory_bytes = {predicted.peak_memory_bytes:.6g} but the largest stage "
                        f"memory is {peak:.6g} bytes (memory figures edited)")
    return problems
