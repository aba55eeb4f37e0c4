"""The mixture-of-experts part of the Megatron-LM export: the zoo `moe` model's experts and routing
as megatron-core's MoE layer builds them, and the plan's expert layout as Megatron-LM's expert
parallelism flags.

Apart from megatron.py (the dense decoder, the layout every plan has, the file): a plan without
experts never reaches this module, and what Megatron-LM's MoE layer does differently from the
zoo's (where the capacity is counted, the load-balancing loss, how expert groups are formed) is
said here, once. Flag names and rules are Megatron-LM core_v0.16.1's (`megatron/training/
arguments.py`, whose MoE flags come from megatron-core's `TransformerConfig` fields through
`ArgumentGroupFactory`; recorded in tests/data/megatron_lm_core_v0.16.1_flags.json).
"""

from __future__ import annotations

from autoplan.cost.config import ParallelConfig
from autoplan.cost.experts import expert_group_ranks
from autoplan.plan import Plan
from autoplan.report.export.common import MoEShape

__all__ = ["expert_layout_args", "moe_model_args"]

Arg = tuple[str, "str | None"]


def moe_model_args(plan: Plan, moe: MoEShape, differences: list[str]) -> list[Arg]:
    """The experts and the router (megatron-core `TransformerConfig` moe_* fields)."""
    args: list[Arg] = [
        ("--num-experts", str(moe.num_experts)),
        ("--moe-ffn-hidden-size", str(moe.expert_ffn_hidden_size)),
        ("--moe-router-topk", str(moe.experts_per_token)),
        # One grouped GEMM over the local experts' variable token counts (TEGroupedMLP), the kernel
        # the published Megatron MoE runs use; the zoo's batched GEMM computes the same products.
        ("--moe-grouped-gemm", None),
        # Tokens to the ranks holding their experts by all-to-all (MoEAlltoAllTokenDispatcher), the
        # exchange autoplan prices (cost/experts.py); Megatron's default is "allgather".
        ("--moe-token-dispatcher-type", "alltoall"),
    ]
    if not moe.normalize_top_k:
        # Megatron's default is top-k over the logits, then softmax over the k: the zoo's softmax,
        # top-k and renormalisation. Without renormalisation the zoo keeps the softmax's values:
        # --moe-router-pre-softmax (softmax over all experts, then top-k).
        args.append(("--moe-router-pre-softmax", None))
    if moe.num_shared_experts:
        # n shared experts are one MLP n times as wide (DeepSeekMoE; models/moe.py).
        args.append(("--moe-shared-expert-intermediate-size", str(moe.num_shared_experts * moe.expert_ffn_hidden_size)))
    if moe.aux_loss_coef:
        args += [("--moe-router-load-balancing-type", "aux_loss"), ("--moe-aux-loss-coeff", repr(float(moe.aux_loss_coef)))]
        if plan.micro_batch_size > 1:
            differences.append("load-balancing loss: the zoo's is Switch Transformer's per sequence, averaged over the "
                               f"micro-batch's {plan.micro_batch_size}; Megatron's aux_loss counts the micro-batch's "
                               "tokens together, a slightly different loss (the same at micro-batch 1)")
    else:
        args.append(("--moe-router-load-balancing-type", "none"))
    if not moe.dropless:
        # Capacity routing: at most capacity_factor x tokens x k / E tokens per expert, the rest
        # dropped in order of position, every expert's input padded to its capacity (the zoo's
        # static dispatch). Dropless leaves --moe-expert-capacity-factor out (None: no token dropped).
        args += [("--moe-expert-capacity-factor", repr(float(moe.capacity_factor))),
                 ("--moe-token-drop-policy", "position"), ("--moe-pad-expert-input-to-capacity", None)]
        if plan.micro_batch_size > 1 or plan.tp > 1:
            differences.append("expert capacity: the zoo counts it per sequence, Megatron over the tokens a rank "
                               "routes (a micro-batch, split over tp under sequence parallelism): the same "
                               "capacity in total, but other tokens may be dropped")
    return args


def expert_layout_args(plan: Plan, differences: list[str]) -> list[Arg]:
    """Expert parallelism: ep and expert tp 1 (every expert whole on the rank that holds it, each tp
    rank dispatching its own share of the tokens: the layout autoplan prices and runs)."""
    args: list[Arg] = []
    if plan.ep > 1:
        args.append(("--expert-model-parallel-size", str(plan.ep)))
    # validate_args defaults the expert tp to the attention's; autoplan's experts are whole (Plan.expert_tp).
    args.append(("--expert-tensor-parallel-size", str(plan.expert_tp)))
    if plan.ep > 1 and plan.tp > 1:
        # Megatron's expert ranks are ep consecutive ranks (parallel_state's expert order
        # tp-ep-dp-pp with expert tp 1: MoE parallel folding); the plan's are ep dp replicas at one
        # tp index (cost/experts.py `expert_group_ranks`).
        per_node = max(1, int((plan.cluster.get("groups") or [{}])[0].get("gpus_per_node", plan.num_gpus)
                              or plan.num_gpus))
        planned = {r // per_node for r in expert_group_ranks(ParallelConfig.of_plan(plan))}
        folded = {r // per_node for r in range(plan.ep)}
        if len(planned) > len(folded):
            differences.append(f"expert groups: Megatron forms its ep {plan.ep} groups from consecutive ranks over tp x "
                               f"dp (MoE parallel folding, {len(folded)} node{'s' if len(folded) > 1 else ''}), the "
                               f"plan from {plan.ep} dp replicas at one tp index ({plan.tp} ranks apart, {len(planned)} "
                               "nodes): Megatron's all-to-all crosses fewer nodes, so the step may be faster than "
                               "predicted")
    return args
