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

from autoplan.plan import Plan
from autoplan.report.export.common import MoEShape, differ

__all__ = ["expert_layout_args", "moe_model_args"]

Arg = tuple[str, "str | None"]


def moe_model_args(plan: Plan, moe: MoEShape, differences: list[str], num_layers: int) -> list[Arg]:
    """The experts and the router (megatron-core `TransformerConfig` moe_* fields) of a model of
    `num_layers` MoE layers."""
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
        if plan.model.startswith("hf:"):
            # transformers' load_balancing_loss_func (modeling_mixtral.py) concatenates every layer's
            # router logits and takes one Switch loss over the pooled tokens; megatron-core's
            # switch_load_balancing_loss_func (transformer/moe/moe_utils.py) takes one per MoE layer and
            # their sum enters the loss. The same coefficient thus weighs the balance about
            # layers / top-k times as much in Megatron-LM (x16 at Mixtral-8x7B's 32 layers, top 2).
            layers, k = num_layers, moe.experts_per_token
            differ(differences, {"model"}, f"load-balancing loss: transformers takes one over every layer's router "
                   f"logits pooled, Megatron-LM one per MoE layer summed, so --moe-aux-loss-coeff "
                   f"{float(moe.aux_loss_coef)!r} weighs the balance about {layers / k:g}x ({layers} layers / top-{k}) "
                   f"as strongly as router_aux_loss_coef does in transformers; {float(moe.aux_loss_coef) * k / layers:.3g} "
                   "would be about as strong")
        elif plan.micro_batch_size > 1:
            differ(differences, {"micro_batch_size", "model"}, "load-balancing loss: the zoo's is Switch Transformer's per sequence, averaged over the "
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
            differ(differences, {"micro_batch_size", "tp", "model"}, "expert capacity: the zoo counts it per sequence, Megatron over the tokens a rank "
                               "routes (a micro-batch, split over tp under sequence parallelism): the same "
                               "capacity in total, but other tokens may be dropped")
    return args


def expert_layout_args(plan: Plan, differences: list[str]) -> list[Arg]:
    """Expert parallelism: ep and expert tp (1: every expert whole on the rank that holds it, each tp
    rank dispatching its own share of the tokens over an ep group folded over tp x dp; tp: the tp
    ranks splitting every expert's hidden units: the layouts autoplan prices and runs, plan.py
    [Note: expert layout], and Megatron-Core's MoE parallel folding, parallel_state's expert rank
    order tp-ep-dp-pp)."""
    args: list[Arg] = []
    if plan.ep > 1:
        args.append(("--expert-model-parallel-size", str(plan.ep)))
    # validate_args defaults the expert tp to the attention's: stated either way (Plan.expert_tp: 1, every
    # expert whole, or tp, each expert's hidden units split over the tp group, Megatron's expert rank
    # order etp-ep-edp with the expert-tp group the tp group).
    args.append(("--expert-tensor-parallel-size", str(plan.expert_tp)))
    return args
