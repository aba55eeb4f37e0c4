"""Published training runs as checks of the cost model: load, predict, fit, gate.

Two files of published measurements (`benchmarks/data/`, copies of the project's shared data):
Megatron-LM's SC'21 Table 1 (ten GPT runs on A100s, tp x pp x dp, interleaved 1F1B, full recompute)
and `modern_runs.json` (FSDP on A100 and H100 from torchtitan and llm-foundry, Megatron-Core MoE
runs on H100). Each run becomes a `PublishedRun`: the model spec, the cluster, the job, every
parallel dimension the source states, the software stack it ran (calibration.py [Note: software
stacks]) and the published step time. `predict` evaluates one run with the search's own evaluation
(search/evaluate.py) at the published dimensions, so what is checked is what `suggest` ranks.

[Note: the published fit]
The calibration numbers fitted here, per GPU chip (A100, H100): the GEMM share of peak, the default
stack's attention share (FlashAttention-2, what torch's SDPA runs) and the `llm-foundry` stack's
(the Triton kernel those runs used), forward and backward alike, each bounded by what its kernel's
published benchmarks reach on the chip (cost/calibration.py [Note: attention kernels]: no fitted
number outside its physical range); shared by both chips: the overlap slowdown
(cost/comm.py [Note: overlap slowdown]), the network efficiency and FSDP's host time per unit and
pass. Megatron-LM 2021 runs under its
own stack (unfused attention, priced from GEMM and memory-bandwidth shares: cost/ops.py), so the
SC'21 table constrains the A100 GEMM share with every other run. The objective is the sum of
squared log errors of the step time; Levenberg-Marquardt (Marquardt 1963, "An Algorithm for
Least-Squares Estimation of Nonlinear Parameters", SIAM J. Appl. Math. 11(2)) on bounded
parameters (a logistic map keeps each share in its range, `bounds`), with a finite-difference Jacobian. The
SC'21 table does not publish micro-batch sizes or virtual stages: they are the search's choice at
the current calibration, held fixed while fitting and chosen again after (two rounds).

Leave one source out: a source is a system with its own stack and reporting conventions
(Megatron-LM SC'21, torchtitan, llm-foundry, the Megatron MoE model zoo, Megatron-LM's MoE README);
the fit without it predicts it. That is the honest estimate of the error on a system nobody has
measured, and `benchmarks/validate_published.py` prints it beside the in-sample error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autoplan import models as zoo
from autoplan.cluster import GPU, parse_cluster
from autoplan.cost.calibration import (
    ATTENTION_SHARE_BOUNDS,
    DEFAULT_STACK,
    Calibration,
    Calibrations,
    default_calibration,
)
from autoplan.cost.config import ParallelConfig
from autoplan.graph.blocks import ModelProfile
from autoplan.graph.profile import profile_model
from autoplan.plan import Job, Plan
from autoplan.search.context import SearchContext
from autoplan.search.evaluate import evaluate

__all__ = ["DATA_DIR", "FIT_PARAMETERS", "LLM_FOUNDRY_STACK", "bounds", "MEGATRON_CORE_STACKS", "SC21_STACK", "STACK_FIT_PARAMETERS", "fit_stacks",
           "fsdp_traffic_floor_s", "SETTING_REASONS", "STACK_REDUCE_DTYPE", "run_settings", "stack_parameters_of", "unfitted_stacks", "with_stack_parameters", "Prediction", "PublishedRun", "apply_parameters",
           "calibrations_for", "chip", "chosen_dimensions", "fit", "load_runs", "measured_start", "neutral", "parameters_of", "predict",
           "predict_all", "run_gpus", "shipped_by_chip", "summary"]

DATA_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
"""Where the published tables live in a checkout (copies of the project's shared data)."""

SC21_STACK = "megatron-lm-2021"
"""The stack of Megatron-LM's 2021 runs: unfused attention (calibration.py [Note: software stacks])."""


@dataclass(frozen=True)
class PublishedRun:
    """One published training run, with every dimension its source states."""

    id: str
    source: str
    """Short name of the system that published it (leave-one-source-out groups by it)."""
    regime: str
    """FSDP, HSDP, TP, TP x PP, CP, MoE, ... (reports group by it)."""
    model: str
    """An autoplan model spec that builds the published shape."""
    cluster: str
    seq_len: int
    global_batch: int
    published_step_s: float
    pins: dict[str, Any]
    """ParallelConfig fields the source states; micro_batch_size / virtual_stages may be absent."""
    stack: str | None = None
    """Calibration stack (None: today's default)."""
    published: str = ""
    """The published figure, verbatim."""
    assumed: dict[str, str] = dataclasses.field(default_factory=dict)
    """Pins the source does not state, each with why it has its value (`run_settings`)."""

    @property
    def fully_pinned(self) -> bool:
        return "micro_batch_size" in self.pins and "virtual_stages" in self.pins


@dataclass
class Prediction:
    run: PublishedRun
    plan: Plan

    @property
    def step_s(self) -> float:
        return self.plan.predicted.step_time_s

    @property
    def error(self) -> float:
        """Predicted step time over published, minus 1 (+: predicted too slow)."""
        return self.step_s / self.run.published_step_s - 1.0


def _source_name(text: str) -> str:
    repo = text.split()[0]
    return {"pytorch/torchtitan": "torchtitan", "mosaicml/llm-foundry": "llm-foundry",
            "yanring/Megatron-MoE-ModelZoo": "megatron-moe-zoo", "NVIDIA/Megatron-LM": "megatron-lm-moe"}.get(repo, repo)


def _sc21_runs(data: dict) -> list[PublishedRun]:
    """Megatron-LM SC'21 Table 1: published TFLOP/s per GPU in the paper's FLOP convention, which counts
    the recompute forward: F = 96 B s l h^2 (1 + s / 6h + V / 16lh) (Narayanan et al. 2021, Eq. 3)."""
    seq, vocab = data["common"]["seq_len"], data["common"]["vocab_size"]
    runs = []
    for values in data["rows"]:
        row = dict(zip(data["columns"], values, strict=True))
        b, h, layers = row["global_batch"], row["hidden"], row["layers"]
        flops = 96 * b * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
        step = flops / (row["gpus"] * row["tflops_per_gpu"] * 1e12)
        dp = row["gpus"] // (row["tp"] * row["pp"])
        # The paper's runs predate the distributed optimizer and sequence parallelism (Korthikanti et
        # al. 2022): a replicated optimizer, activations replicated over tp outside attention and MLP.
        pins = {"tp": row["tp"], "pp": row["pp"], "dp": dp, "recompute": "full", "zero": 0,
                "sequence_parallel": False, "schedule": "interleaved-1f1b" if row["pp"] > 1 else "1f1b"}
        assumed = {"sequence_parallel": "predates it", "zero": "predates it"}
        if row["pp"] == 1:
            pins["virtual_stages"] = 1
        regime = "TP x PP" if row["pp"] > 1 else ("TP" if row["tp"] > 1 else "DP")
        runs.append(PublishedRun(
            id=f"sc21_{row['params_billion']:g}b", source="megatron-sc21", regime=regime,
            model=(f"gpt:num_layers={layers},hidden_size={h},num_heads={row['heads']},vocab_size={vocab},"
                   f"max_seq_len={seq}"),
            cluster=f"{row['gpus'] // 8}x8xA100-80GB", seq_len=seq, global_batch=b, published_step_s=step,
            pins=pins, stack=SC21_STACK, published=f"{row['tflops_per_gpu']} TFLOP/s per GPU", assumed=assumed))
    return runs


LLM_FOUNDRY_STACK = "llm-foundry"
"""The stack of llm-foundry's benchmark runs: a Triton flash attention (every row's precision field
says "triton flash-attn"; cost/calibration.py [Note: attention kernels])."""

_STACK_OF_SOURCE = {"torchtitan": "torchtitan", "llm-foundry": LLM_FOUNDRY_STACK}
"""Sources whose runs used a named stack other than the default (calibration.py [Note: software
stacks]): torchtitan's `selective` activation checkpointing is its operator-level policy;
llm-foundry's attention is its Triton kernel."""


MEGATRON_CORE_STACKS = {"A2A": "megatron-core", "DeepEP": "megatron-core-deepep"}
"""The stacks of the Megatron-Core mixture-of-experts runs, by the token dispatcher their rows name
(calibration.py [Note: software stacks]; [Note: Megatron-Core's MoE stack] below)."""

# [Note: Megatron-Core's MoE stack]
# The mixture-of-experts runs (Megatron-LM's MoE README, the Megatron MoE model zoo) ran
# Megatron-Core with Transformer Engine: fused attention (cuDNN / flash, `--use-flash-attn`,
# `--transformer-impl transformer_engine`), dropless routing over grouped GEMMs, and a token
# dispatcher that brings each layer's token counts to the host. Each row says which dispatcher:
# "A2A" (per-copy all-to-all) or "DeepEP" (a token once per destination rank). The shared data's
# Qwen3-235B rows say "DeepEP or A2A"; the table they cite (best_practice/Qwen3/readme.md at
# c1ad0b5) lists DeepEP for both rows, which is what a row naming DeepEP is priced with. Such a run is
# profiled with dropless routing when its row says dropless (the zoo moe's `dropless`: tokens x k
# routed copies, no capacity padding; a `capacity_factor` in the row's spec gives way to it), and
# priced under the stack of its dispatcher: the dispatch share (cost/experts.py `dispatch_share`)
# from the combinatorics of routing, tensor-parallel communication inside the GEMMs (the model zoo's
# sbatch_benchmarking.sh adds `--tp-comm-overlap` to every bf16 run: `tp_comm_overlap`), and two
# numbers fitted to these runs alone, the attention share
# of Transformer Engine's fused attention and the host's time per kernel after each layer's sync
# (`fit_stacks`). The dense fit never sees these runs, and these two numbers move no dense run.


def _moe_run_spec(spec: str, precision: str) -> str:
    """The zoo spec of a Megatron-Core MoE row as it ran ([Note: Megatron-Core's MoE stack])."""
    if "dropless" not in precision.lower():
        return spec
    name, _, fields = spec.partition(":")
    kept = [f for f in fields.split(",") if f and not f.startswith(("capacity_factor=", "dropless="))]
    return f"{name}:{','.join([*kept, 'dropless=true'])}"


def _moe_stack(precision: str) -> str:
    """The Megatron-Core stack of a MoE row, by the dispatcher its precision field names."""
    return MEGATRON_CORE_STACKS["DeepEP" if "deepep" in precision.lower() else "A2A"]


def _modern_runs(data: dict) -> list[PublishedRun]:
    runs = []
    for r in data["runs"]:
        replicas = r["dp"] // r["cp"]
        pins = {"tp": r["tp"], "pp": r["pp"], "dp": r["dp"], "cp": r["cp"], "ep": r["ep"], "zero": r["zero"],
                "dp_replicate": r.get("dp_replicate", 1), "micro_batch_size": r["mbs"],
                "num_microbatches": r["global_batch"] // (replicas * r["mbs"]),
                "schedule": r["schedule"] if r["pp"] > 1 else "1f1b",
                "virtual_stages": r.get("virtual_stages", 1) or 1, "recompute": r["recompute"],
                "sequence_parallel": bool(r.get("sequence_parallel", False))}
        assumed = {}
        if "sequence_parallel" not in r:
            assumed["sequence_parallel"] = "stack default"
        if "pure" in r.get("precision", "").lower():
            # Composer's FSDP mixed_precision PURE: parameters, gradient reduction and buffers in
            # bf16 ([Note: the reduce dtype a published run implies]); stated by the row.
            pins["reduce_dtype"] = "bfloat16"
        regime = r["category"]
        if regime == "FSDP" and pins["dp_replicate"] > 1:
            regime = "HSDP"
        model, stack = r["model"]["spec"], _STACK_OF_SOURCE.get(_source_name(r["source"]))
        if regime == "MoE":
            precision = r.get("precision", "")
            model, stack = _moe_run_spec(model, precision), _moe_stack(precision)
        runs.append(PublishedRun(
            id=r["id"], source=_source_name(r["source"]), regime=regime, model=model,
            cluster=f"{r['nodes']}x{r['gpus_per_node']}x{r['cluster_kind']}", seq_len=r["seq"],
            global_batch=r["global_batch"], published_step_s=float(r["step_s"]), pins=pins, published=r["measured"],
            stack=stack, assumed=assumed))
    return runs


SETTING_REASONS = {
    "stack default": "what the run's stack does unless told otherwise ([Note: the reduce dtype a published run "
                     "implies]; sequence parallelism is off in every stack unless asked for)",
    "search's choice": "not published: the fastest that fits at the published dimensions, as the search "
                       "would choose it ([Note: the published fit])",
    "predates it": "Megatron-LM SC'21 ran before sequence parallelism and the distributed optimizer "
                   "(Korthikanti et al. 2022): replicated optimizer, no sequence parallelism",
}
"""What each `run_settings` "assumed: ..." reason means (printed once under the table)."""


def run_settings(run: PublishedRun, plan: Plan | None = None) -> list[tuple[str, str, str]]:
    """(setting, value, how) for the settings a prediction depends on that a source may leave out:
    how is "stated" or "assumed: <reason>", a key of SETTING_REASONS ([Note: the reduce dtype a
    published run implies]). `plan`: the prediction's, for the micro-batch size and virtual stages
    the search chose where the source does not state them."""
    out = [("stack", run.stack or DEFAULT_STACK, "stated")]
    reduce = run.pins.get("reduce_dtype")
    out.append(("reduce", {"float32": "fp32", "bfloat16": "bf16"}.get(reduce or STACK_REDUCE_DTYPE, str(reduce)),
                "stated" if reduce else "assumed: stack default"))
    for name, label in (("micro_batch_size", "micro-batch"), ("virtual_stages", "virtual stages")):
        if name in run.pins:
            out.append((label, str(run.pins[name]), "stated"))
        else:
            out.append((label, str(getattr(plan, name)) if plan is not None else "?", "assumed: search's choice"))
    why = run.assumed.get("sequence_parallel")
    out.append(("sequence parallel", "on" if run.pins.get("sequence_parallel") else "off",
                f"assumed: {why}" if why else "stated"))
    return out


def load_runs(data_dir: Path = DATA_DIR) -> list[PublishedRun]:
    """Every run of both published files, SC'21 first."""
    sc21 = json.loads((data_dir / "megatron_sc21_table1.json").read_text())
    modern = json.loads((data_dir / "modern_runs.json").read_text())
    return _sc21_runs(sc21) + _modern_runs(modern)


_PROFILES: dict[tuple[str, int], ModelProfile] = {}

# [Note: the reduce dtype a published run implies]
# A prediction never reads the figure it is checked against: a setting a row does not state takes
# the default of the stack the row ran, never a value inferred from its published step time. (An
# earlier rule priced the Qwen3-235B FSDP row with bf16 reduction because its fp32 traffic floor
# exceeded its published step: that read the answer, and is gone; issue 40.) The reduce dtype of
# FSDP / ZeRO gradients is such a setting. What the stacks here do unless told otherwise:
# - Megatron-LM and Megatron-Core, Megatron-FSDP included (its DistributedDataParallelConfig is
#   built from the same arguments), reduce in fp32 under --bf16: megatron/training/arguments.py,
#   validate_args, sets `accumulate_allreduce_grads_in_fp32 = True` unless `--grad-reduce-in-bf16`
#   is given (its default is False).
# - torchtitan: `mixed_precision_reduce = "float32"` (torchtitan config, `Training`), FSDP2's
#   `MixedPrecisionPolicy(reduce_dtype=float32)`.
# - llm-foundry (Composer's FSDP `mixed_precision`): `DEFAULT` reduces in fp32, `PURE` keeps
#   parameters, gradient reduction and buffers in bf16 (Composer docs, "FSDP: mixed_precision").
#   Those rows state which in their precision field, so they are priced as stated.
# `STACK_REDUCE_DTYPE` is that default; `run_settings` lists, per run, what it states and what was
# assumed, and benchmarks/validate_published.py prints it. `fsdp_traffic_floor_s` remains as a
# diagnostic (the least time a ZeRO-3 run's collectives can take on its stated links, the bandwidth
# bound of Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication
# Operations in MPICH", IJHPCA 19(1), Sec. 2, per node): it is printed, never used to price a run.
STACK_REDUCE_DTYPE = "float32"
"""The gradient reduce dtype every stack here uses unless a run states another ([Note: the reduce
dtype a published run implies])."""


def fsdp_traffic_floor_s(run: PublishedRun, reduce_dtype: str = "float32") -> float:
    """Seconds the FSDP collectives of a ZeRO-3 run at pp 1 need at least on its stated links, every
    micro-batch's two all-gathers and one reduce-scatter of every unit ([Note: the reduce dtype a
    published run implies]). 0 for a run that is not ZeRO-3 at pp 1."""
    from autoplan.cost.comm import fsdp_groups
    from autoplan.cost.memory import (
        expert_params,
        gathered_bytes_per_param,
        param_counts,
        reduced_bytes_per_param,
    )

    pins = run.pins
    if pins.get("zero", 0) < 3 or pins.get("pp", 1) != 1 or "micro_batch_size" not in pins:
        return 0.0
    cfg = ParallelConfig(**pins, reduce_dtype=reduce_dtype)
    prof = _profile(run)
    cluster = parse_cluster(run.cluster)
    per_param = 2 * gathered_bytes_per_param("bfloat16") + reduced_bytes_per_param(reduce_dtype)

    def seconds(ranks: Sequence[int], params: float) -> float:
        # Per node: the bytes its members of the group lack, brought in once over its NICs.
        nodes = {cluster.node_of_rank(r) for r in ranks}
        if len(ranks) <= 1 or len(nodes) <= 1 or params <= 0:
            return 0.0
        members = len(ranks) // len(nodes)
        groups_on_node = cluster.gpus_per_node // members
        node_bw = cluster.gpus_per_node * cluster.inter_node.bw_bytes_per_s
        return groups_on_node * params * per_param * (1 - members / len(ranks)) / node_bw

    experts = np.asarray(expert_params(prof), dtype=float) / cfg.ep if cfg.ep > 1 else np.zeros(prof.num_blocks)
    dense = param_counts(prof, cfg) - experts
    first = cfg.rank(0, 0, 0)
    shard, _ = fsdp_groups(first, cfg.rank(0, 1, 0) - first if cfg.dp > 1 else 1, cfg.dp, cfg.dp_replicate)
    expert_shard, _ = cfg.expert_fsdp_groups(0)
    per_microbatch = sum(seconds(shard, float(n)) for n in dense) + sum(seconds(expert_shard, float(n)) for n in experts)
    return cfg.num_microbatches * per_microbatch


def _profile(run: PublishedRun) -> ModelProfile:
    key = (run.model, run.seq_len)
    if key not in _PROFILES:
        model = zoo.build_model(run.model)
        prof, _ = profile_model(model, zoo.example_inputs(run.model, 1, run.seq_len), loss_fn=zoo.lm_loss,
                                example_target=zoo.example_targets(run.model, 1, run.seq_len), model_name=run.model,
                                info={k: v for k, v in zoo.model_info(run.model).items() if isinstance(v, int)})
        _PROFILES[key] = prof
    return _PROFILES[key]


def predict(run: PublishedRun, calibrations: Calibrations | None = None,
            chosen: dict[str, int] | None = None) -> Prediction:
    """The plan of `run` at its published dimensions. Dimensions the source does not state (SC'21's
    micro-batch size and virtual stages) come from `chosen`, else the fastest that fits
    (`_unstated_choices`)."""
    cals = dataclasses.replace(calibrations or Calibrations(), stack=run.stack)
    prof = _profile(run)
    cluster = parse_cluster(run.cluster)
    job = Job(global_batch=run.global_batch, seq_len=run.seq_len, dtype="bfloat16")
    pins = {**run.pins, **(chosen or {})}
    pins.setdefault("reduce_dtype", STACK_REDUCE_DTYPE)  # [Note: the reduce dtype a published run implies]
    if "micro_batch_size" in pins and "virtual_stages" in pins:
        if "num_microbatches" not in pins:
            pins["num_microbatches"] = run.global_batch // (pins["dp"] // pins.get("cp", 1) * pins["micro_batch_size"])
        ctx = SearchContext(prof, cluster, job, run.model, cals)
        evaluation = evaluate(ctx, ParallelConfig(**pins), require_fit=False)
        if evaluation is None:
            raise ValueError(f"{run.id}: autoplan cannot evaluate the published configuration {pins}")
        return Prediction(run, evaluation.plan)
    ctx = SearchContext(prof, cluster, job, run.model, cals)
    best = None
    for cfg in _unstated_choices(run, prof.num_blocks, pins):
        try:
            evaluation = evaluate(ctx, cfg, require_fit=False)
        except ValueError:  # a schedule that cannot take this micro-batch count
            continue
        if evaluation is None:
            continue
        plan = evaluation.plan
        rank = (not plan.fits, plan.predicted.step_time_s if plan.fits else plan.predicted.peak_memory_bytes)
        if best is None or rank < best[0]:
            best = (rank, plan)
    if best is None:
        raise ValueError(f"{run.id}: no micro-batch size or virtual stage count runs the published dimensions {pins}")
    return Prediction(run, best[1])


def _unstated_choices(run: PublishedRun, num_blocks: int, pins: dict[str, Any]) -> list[ParallelConfig]:
    """Every micro-batch size (up to 8) and virtual stage count (up to 8) the published dimensions
    allow: the fastest that fits stands for the unpublished choice, as the search would make it. (The
    search itself prunes with a memory reserve taken before cutting, which can refuse a configuration
    that fits once cut.) `pins`: the run's, with what `predict` adds (the stack's reduce dtype)."""
    replicas = pins["dp"] // pins.get("cp", 1)
    per_replica = run.global_batch // replicas
    out = []
    for mbs in (1, 2, 4, 8):
        if per_replica % mbs:
            continue
        stages = [1] if pins["pp"] == 1 or pins["schedule"] != "interleaved-1f1b" else range(2, 9)
        for v in stages:
            if pins["pp"] * v > num_blocks:
                break
            out.append(ParallelConfig(**{**pins, "micro_batch_size": mbs, "virtual_stages": v,
                                         "num_microbatches": per_replica // mbs}))
    return out


def predict_all(runs: Sequence[PublishedRun], calibrations: Calibrations | None = None,
                chosen: dict[str, dict[str, int]] | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[Prediction]:
    """`predict` of every run; `progress(done, total)` after each (for a progress line)."""
    out = []
    for r in runs:
        out.append(predict(r, calibrations, (chosen or {}).get(r.id)))
        if progress:
            progress(len(out), len(runs))
    return out


def chosen_dimensions(predictions: Sequence[Prediction]) -> dict[str, dict[str, int]]:
    """The unstated dimensions the search chose, per run, to hold fixed ([Note: the published fit])."""
    return {p.run.id: {"micro_batch_size": p.plan.micro_batch_size, "virtual_stages": p.plan.virtual_stages}
            for p in predictions if not p.run.fully_pinned}


def chip(gpu_name: str) -> str:
    """The chip a GPU type is built on: calibrations are fitted per chip (A100-40GB and -80GB share one)."""
    family = gpu_name.split("-")[0]
    return {"H200": "H100"}.get(family, family)


FIT_PARAMETERS = ("A100.gemm", "A100.attention", "A100.triton", "H100.gemm", "H100.attention", "H100.triton",
                  "overlap_slowdown", "network_efficiency", "fsdp_unit_overhead_s")
"""What [Note: the published fit] solves for: per chip the GEMM share, the default stack's attention
share (FlashAttention-2) and the `llm-foundry` stack's (its Triton kernel), each attention share
within its kernel's published range (cost/calibration.py [Note: attention kernels]). A chip's
attention share no run of that kernel constrains keeps its starting value (the H100's
FlashAttention-2 share: no dense H100 run used it; it stays at this project's own block
measurements, `measured_start`). (The memory-bandwidth share was tried too: the runs cannot tell it
from the others, and the leave-one-source-out fits sent it to its bound, 0.4; it stays at the
calibration's value.)"""

_KERNEL_OF_PARAMETER = {"attention": "flash2", "triton": "triton"}
"""The attention kernel each per-chip attention parameter describes."""

_BOUNDS = {"gemm": (0.2, 0.95), "memory": (0.4, 1.0), "overlap_slowdown": (0.0, 0.6),
           "network_efficiency": (0.3, 1.0), "fsdp_unit_overhead_s": (0.0, 0.01)}


def bounds(name: str) -> tuple[float, float]:
    """Where the FIT_PARAMETERS `name` may lie: an attention share within its kernel's published
    range on its chip (ATTENTION_SHARE_BOUNDS), every other number within a physical range."""
    family, _, what = name.rpartition(".")
    if what in _KERNEL_OF_PARAMETER:
        return ATTENTION_SHARE_BOUNDS[(_KERNEL_OF_PARAMETER[what], family)]
    return _BOUNDS[what]


_bounds = bounds


def _attention_parameter(run: PublishedRun) -> str | None:
    """The per-chip attention parameter a run's stack prices its attention with (None: unfused, or a
    stack fitted apart)."""
    if run.stack == LLM_FOUNDRY_STACK:
        return "triton"
    if run.stack in (SC21_STACK, *MEGATRON_CORE_STACKS.values()):
        return None
    return "attention"


def parameters_of(cals: dict[str, Calibration]) -> np.ndarray:
    """The fitted numbers of per-chip calibrations, in FIT_PARAMETERS order."""
    out = []
    for name in FIT_PARAMETERS:
        if "." in name:
            family, what = name.split(".")
            cal = cals[family]
            if what == "triton":
                out.append(float(cal.stacks[LLM_FOUNDRY_STACK]["attention_fwd_efficiency"]))
                continue
            out.append({"gemm": cal.gemm("bf16"), "attention": cal.attention_fwd_efficiency,
                        "memory": cal.memory_bandwidth_efficiency}[what])
        else:
            out.append(getattr(cals["A100"], name))
    return np.array(out)


def apply_parameters(cals: dict[str, Calibration], values: Sequence[float]) -> dict[str, Calibration]:
    """Per-chip calibrations with the FIT_PARAMETERS set to `values`."""
    out = dict(cals)
    for name, value in zip(FIT_PARAMETERS, values, strict=True):
        families = [name.split(".")[0]] if "." in name else list(out)
        for family in families:
            cal = out[family]
            what = name.split(".")[-1]
            if what == "gemm":
                gemm = {k: (float(value) if k in ("bf16", "fp16") else v) for k, v in cal.gemm_efficiency.items()}
                cal = cal.replace(gemm_efficiency=gemm)
            elif what == "attention":
                cal = cal.replace(attention_fwd_efficiency=float(value), attention_bwd_efficiency=float(value))
            elif what == "triton":
                stacks = {k: dict(v) for k, v in cal.stacks.items()}
                stacks[LLM_FOUNDRY_STACK].update(attention_fwd_efficiency=float(value),
                                                 attention_bwd_efficiency=float(value))
                cal = cal.replace(stacks=stacks)
            elif what == "memory":
                cal = cal.replace(memory_bandwidth_efficiency=float(value))
            else:
                cal = cal.replace(**{what: float(value)})
            out[family] = cal
    return out


def calibrations_for(cals: dict[str, Calibration], gpus: Sequence[GPU]) -> Calibrations:
    """Overrides for every GPU type of the runs, from its chip's calibration."""
    return Calibrations({g.name: cals[chip(g.name)].replace(gpu=g.name) for g in gpus if chip(g.name) in cals})


def run_gpus(runs: Sequence[PublishedRun]) -> list[GPU]:
    seen: dict[str, GPU] = {}
    for r in runs:
        for g in parse_cluster(r.cluster).gpu_types:
            seen[g.name] = g
    return list(seen.values())


def shipped_by_chip(runs: Sequence[PublishedRun]) -> dict[str, Calibration]:
    out: dict[str, Calibration] = {}
    for g in run_gpus(runs):
        out.setdefault(chip(g.name), default_calibration(g))
    return out


NEUTRAL_START = {"gemm": 0.6, "memory": 0.8, "overlap_slowdown": 0.1, "network_efficiency": 0.8,
                 "fsdp_unit_overhead_s": 0.0005}
"""Where leave-one-source-out refits start: round figures, not the full fit (which has seen the source);
an attention share starts in the middle of its kernel's published range. A chip with measurements of
this project's own starts from them instead (`measured_start`)."""

MEASURED_BLOCKS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "fit_measured_blocks_{chip}.json"
"""Block times this project measured on a GPU, fitted by benchmarks/fit_measured_blocks.py."""


def measured_start(family: str) -> dict[str, float]:
    """The GEMM and attention shares this project measured on `family`'s blocks, where it has them: the
    attention share is the forward and backward ones combined as the fit uses one for both (the
    backward does 2.5x the forward's FLOPs: Dao 2023, Sec. 3.1.2), 3.5 / (1 / fwd + 2.5 / bwd)."""
    path = Path(str(MEASURED_BLOCKS).format(chip=family.lower()))
    if not path.exists():
        return {}
    cal = json.loads(path.read_text())["calibration"]
    fwd, bwd = cal["attention"]["fwd_efficiency"], cal["attention"]["bwd_efficiency"]
    return {"gemm": cal["gemm"]["efficiency"]["bf16"], "attention": 3.5 / (1 / fwd + 2.5 / bwd),
            "memory": cal["memory"]["bandwidth_efficiency"]}


def neutral(cals: dict[str, Calibration]) -> dict[str, Calibration]:
    """The starting point of a leave-one-source-out fit: measured shares where this project measured
    the chip (a fit without any run on it keeps them), round figures elsewhere."""
    values = []
    for name in FIT_PARAMETERS:
        family, what = name.split(".") if "." in name else ("", name)
        # An attention share: the middle of its kernel's published range.
        start = sum(bounds(name)) / 2 if what in _KERNEL_OF_PARAMETER else NEUTRAL_START[what]
        values.append(measured_start(family).get(what, start) if family else start)
    return apply_parameters(cals, values)


def _to_unit(values: np.ndarray) -> np.ndarray:
    lo, hi = np.array([_bounds(n) for n in FIT_PARAMETERS]).T
    share = np.clip((values - lo) / (hi - lo), 1e-4, 1 - 1e-4)
    return np.log(share / (1 - share))


def _from_unit(u: np.ndarray) -> np.ndarray:
    lo, hi = np.array([_bounds(n) for n in FIT_PARAMETERS]).T
    return lo + (hi - lo) / (1 + np.exp(-u))


def fit(runs: Sequence[PublishedRun], start: dict[str, Calibration], *, rounds: int = 2, iterations: int = 8,
        progress: Callable[[str], None] | None = None) -> tuple[dict[str, Calibration], dict[str, dict[str, int]]]:
    """[Note: the published fit] over `runs` from the per-chip calibrations `start`. Returns the fitted
    per-chip calibrations and the unstated dimensions chosen for each run under them. Parameters of a
    chip none of the runs use keep their starting values."""
    gpus = run_gpus(runs)
    used = {chip(g.name) for g in gpus}
    # An attention share is free only where some run prices attention with it (its kernel on its chip).
    kernels = {(chip(g.name), _attention_parameter(r)) for r in runs for g in parse_cluster(r.cluster).gpu_types}
    free = [i for i, n in enumerate(FIT_PARAMETERS)
            if "." not in n or (n.split(".")[0] in used
                                and (n.split(".")[1] not in _KERNEL_OF_PARAMETER or tuple(n.split(".")) in kernels))]
    cals = dict(start)
    chosen = chosen_dimensions(predict_all(runs, calibrations_for(cals, gpus)))
    target = np.log([r.published_step_s for r in runs])
    for round_index in range(rounds):
        u = _to_unit(parameters_of(cals))

        def residuals(unit: np.ndarray, cals=cals, chosen=chosen) -> np.ndarray:
            trial = apply_parameters(cals, _from_unit(unit))
            steps = [p.step_s for p in predict_all(runs, calibrations_for(trial, gpus), chosen)]
            return np.log(steps) - target

        r = residuals(u)
        damping = 1e-2
        for it in range(iterations):
            jac = np.zeros((len(r), len(FIT_PARAMETERS)))
            for k in free:
                step = np.zeros_like(u)
                step[k] = 1e-3 * max(1.0, abs(u[k]))
                jac[:, k] = (residuals(u + step) - r) / step[k]
            grad = jac.T @ r
            normal = jac.T @ jac
            improved = False
            for _ in range(6):
                lhs = normal + damping * np.diag(np.diag(normal) + 1e-9)
                delta = np.zeros_like(u)
                delta[free] = -np.linalg.solve(lhs[np.ix_(free, free)], grad[free])
                trial_r = residuals(u + delta)
                if trial_r @ trial_r < r @ r:
                    u, r, damping, improved = u + delta, trial_r, max(damping / 3, 1e-6), True
                    break
                damping *= 4
            if progress:
                progress(f"fit round {round_index + 1} iteration {it + 1}: rms log error {math.sqrt(r @ r / len(r)):.4f}")
            if not improved or float(np.abs(delta).max()) < 1e-3:
                break
        cals = apply_parameters(cals, _from_unit(u))
        chosen = chosen_dimensions(predict_all(runs, calibrations_for(cals, gpus)))
    return cals, chosen


STACK_FIT_PARAMETERS = ("attention", "host_sync_kernel_s")
"""What `fit_stacks` solves for, shared by the Megatron-Core stacks ([Note: Megatron-Core's MoE stack])."""


STACK_ATTENTION_BOUNDS = ATTENTION_SHARE_BOUNDS[("cudnn", "H100")]
"""Where the Megatron-Core stacks' attention share may lie: Transformer Engine's fused attention on
an H100 is cuDNN's kernel (its `FusedAttention` backend), whose published BF16 forward and backward
reach 0.27-0.62 of dense peak (cost/calibration.py [Note: attention kernels]: Shah et al. 2024,
Figs. 5-6). One share serves forward and backward, as in the dense fit."""


def stack_parameters_of(cals: dict[str, Calibration], family: str = "H100") -> tuple[float, float]:
    """The Megatron-Core stacks' fitted numbers in `family`'s calibration (STACK_FIT_PARAMETERS order)."""
    variant = cals[family].stacks.get(MEGATRON_CORE_STACKS["A2A"], {})
    return float(variant.get("attention_fwd_efficiency", 0.0)), float(variant.get("host_sync_kernel_s", 0.0))


def with_stack_parameters(cals: dict[str, Calibration], families: Sequence[str], attention: float,
                          host_sync_kernel_s: float) -> dict[str, Calibration]:
    """Per-chip calibrations whose Megatron-Core stacks have these numbers (one attention share
    forward and backward, as the dense fit uses), rounded as they are written. A chip whose
    calibration does not describe those stacks is left as it is."""
    out = dict(cals)
    for family in families:
        stacks = {name: dict(fields) for name, fields in out[family].stacks.items()}
        for name in MEGATRON_CORE_STACKS.values():
            if name in stacks:
                stacks[name].update(attention_fwd_efficiency=round(float(attention), 4),
                                    attention_bwd_efficiency=round(float(attention), 4),
                                    host_sync_kernel_s=round(float(host_sync_kernel_s), 9))
        out[family] = out[family].replace(stacks=stacks)
    return out


def unfitted_stacks(cals: dict[str, Calibration], families: Sequence[str]) -> dict[str, Calibration]:
    """The Megatron-Core stacks with no numbers fitted to any MoE run: the chip's own attention share
    and no host term (what leave-one-source-out prices a source with when no other source has MoE
    runs to fit them)."""
    out = dict(cals)
    for family in families:
        out = with_stack_parameters(out, [family], out[family].attention_fwd_efficiency, 0.0)
    return out


def fit_stacks(runs: Sequence[PublishedRun], cals: dict[str, Calibration],
               progress: Callable[[str], None] | None = None) -> dict[str, Calibration]:
    """[Note: Megatron-Core's MoE stack]: the attention share and the host's time per kernel of the
    Megatron-Core stacks, fitted to those of `runs` that ran one, every other number held. Two
    numbers on a handful of runs: a grid (coarse, then a finer one around the best point) on the sum
    of squared log errors of the step time, which shows the whole surface rather than one descent.
    Calibrations of chips none of those runs use, and runs of other stacks, are left as they are."""
    moe = [r for r in runs if r.stack in MEGATRON_CORE_STACKS.values()]
    if not moe:
        return cals
    gpus = run_gpus(moe)
    families = sorted({chip(g.name) for g in gpus})
    target = np.log([r.published_step_s for r in moe])

    def loss(attention: float, host: float) -> float:
        trial = with_stack_parameters(cals, families, attention, host)
        steps = [p.step_s for p in predict_all(moe, calibrations_for(trial, gpus))]
        return float(np.sum((np.log(steps) - target) ** 2))

    # Attention in steps of 0.05 over its bounds; the host's time per kernel from 0 (a host always
    # ahead) to 80 us (eight times the kernel floor, well past eager PyTorch's own 9 us per kernel on
    # this project's CPU: benchmarks/host_per_kernel_cpu.py) in steps of 10 us; then a grid of half
    # those steps around the best point.
    (low, high), attention_step, host_step = STACK_ATTENTION_BOUNDS, 0.05, 10e-6
    grid = [(a, h) for a in np.arange(low, high + 1e-9, attention_step) for h in np.arange(0.0, 80e-6 + 1e-12, host_step)]
    best = min(grid, key=lambda point: loss(*point))
    if progress:
        progress(f"stack fit (coarse): attention {best[0]:.2f}, host per kernel {best[1] * 1e6:.0f} us")
    fine = [(min(high, max(low, best[0] + da)), max(0.0, best[1] + dh))
            for da in np.linspace(-attention_step / 2, attention_step / 2, 5)
            for dh in np.linspace(-host_step / 2, host_step / 2, 5)]
    error, best = min((loss(*point), point) for point in fine)
    if progress:
        progress(f"stack fit: attention {best[0]:.3f}, host per kernel {best[1] * 1e6:.1f} us, "
                 f"rms log error {math.sqrt(error / len(moe)):.4f} over {len(moe)} runs")
    return with_stack_parameters(cals, families, *best)


def summary(errors: Sequence[float]) -> dict[str, float]:
    absolute = [abs(e) for e in errors]
    return {"median": statistics.median(absolute), "worst": max(absolute), "count": len(absolute)} if absolute else {}
