"""The mixture-of-experts Llama: experts reached through buffers of fixed shape ([Note: static
dispatch]) or, with `dropless`, every token routed to all of its experts ([Note: dropless
routing]), with a load-balancing loss attached through graph/aux_loss.py.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from autoplan.graph.aux_loss import attach_aux_loss
from autoplan.graph.grouped_mm import grouped_mm
from autoplan.graph.positions import sum_over_sequence
from autoplan.models.common import INIT_STD, make_embedding
from autoplan.models.config import MoEConfig
from autoplan.models.llama import LlamaAttention, LlamaMLP, LlamaModel
from autoplan.models.ops import RMSNorm, swiglu

__all__ = ["GroupedExperts", "MoEFeedForward", "MoELayer", "MoEModel", "RoutedExperts", "expert_capacity"]

# ---------------------------------------------------------------------------------------------
# Mixture of experts
#
# [Note: static dispatch]
# Tokens reach their experts through buffers of fixed shape: each expert takes at most `capacity`
# tokens of each sequence (`expert_capacity`), in token order, and a token over an expert's
# capacity skips it (GShard, arXiv:2006.16668, Algorithm 1 with one group per sequence). Fixed
# shapes let the model build and trace on meta, let FlopCounterMode count the experts' FLOPs at
# the capacity the run uses, and make expert parallelism one `all_to_all` of equal splits. One
# group per sequence makes the dropping, and the load-balancing loss computed per sequence
# (DeepSeek-V3's sequence-wise balance loss, arXiv:2412.19437 Eq. 17-20, with Switch's weighting),
# independent of how the batch is split into micro-batches and data-parallel shards, so a
# pipelined run reproduces a single-process one exactly.
#
# [Note: capacity under context parallelism]
# Under context parallelism (runtime/parallel/context.py) a layer sees only the tokens its rank holds of each
# sequence (chunks i and 2 cp - 1 - i, in that order), and counts the capacity over them:
# ceil(capacity_factor * (seq_len / cp) * k / E) per expert, the queue in the order the tokens are
# held. This is Megatron-LM's capacity (megatron/core/transformer/moe/moe_utils.py at core_v0.16.1,
# 55ac7082517c3878ae653c07c09c534b8aed49f6: `apply_router_token_dropping` calls `get_capacity` with
# the rows of the router's logits, which `TopKRouter.routing` in router.py flattens from the
# [seq / cp, batch] hidden states a cp rank holds; megatron/core/utils.py `get_batch_on_this_cp_rank`
# gives it chunks i and 2 cp - 1 - i). The same capacity in total, but a rank drops by its own
# tokens' load, so which tokens are dropped depends on the cp degree: a cp run equals one process
# that applies the capacity to each rank's share of every sequence, not one that applies it to the
# whole sequence (tests/test_cp_capacity_experts.py), and equals one process exactly at
# capacity_factor >= E / k or with `dropless`, where nothing drops. The plan and `run` say so
# (`sequence_split_note`). The balance loss is unaffected: it sums its counts over the cp group.
#
# [Note: dropless routing]
# With `dropless` (MoEConfig) every token reaches its k experts whatever their load, torchtitan's
# and Megatron-LM's default (torchtitan's `TokenChoiceTopKRouter` and `GroupedExperts` with
# `torch._grouped_mm`; Megatron-LM's `--moe-token-dispatcher-type alltoall` without
# `--moe-expert-capacity-factor`). The router's choice goes to `RoutedExperts`, which takes the
# tokens with their expert indices and weights (graph/experts.py's routed experts, the contract of
# transformers' MixtralExperts), sorts the (token, expert) copies by expert and runs one grouped GEMM
# over the variable counts (graph/grouped_mm.py: torch._grouped_mm runs only on CUDA in bf16 in torch
# 2.13, so a loop over the experts on the CPU, with fixed output shapes for fake runs). Expert
# parallelism sends the copies with variable all-to-all splits (runtime/parallel/routed_experts.py). The
# balance loss is the same per-sequence loss as capacity routing's.


def expert_capacity(seq_len: int, experts_per_token: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens of one sequence one expert takes: ceil(capacity_factor * seq_len * k / E) (GShard
    Sec. 2.2, per group; a group here is one sequence), at least 1 and at most seq_len (a token
    picks an expert once)."""
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * experts_per_token / num_experts)))


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked matrices, applied to tokens grouped by expert:
    input (experts, tokens, h) -> (experts, tokens, h), one batched matmul per matrix.

    The leading dimension of every parameter and of the input is the expert, so an expert-parallel
    runtime can keep a slice of the experts on each rank and exchange the token groups (the
    contract `runtime/parallel/experts.py` relies on; torchtitan's GroupedExperts has the same layout)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        # Megatron-LM scaled_init_method_normal for the output projection, as in LlamaMLP.
        self.init_stds = {"w2": INIT_STD / math.sqrt(2 * num_layers)}

    def forward(self, tokens: Tensor) -> Tensor:
        return torch.bmm(swiglu(torch.bmm(tokens, self.w1), torch.bmm(tokens, self.w3)), self.w2)


class RoutedExperts(GroupedExperts):
    """GroupedExperts' weights, applied to tokens with the router's choice ([Note: dropless
    routing]): forward(tokens (T, h), expert indices (T, k), weights (T, k)) -> (T, h), each
    token's weighted sum over its k experts."""

    def forward(self, tokens: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        k = indices.shape[1]
        flat = indices.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, k) copies grouped by expert
        source = order // k
        rows = tokens.index_select(0, source)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))  # a fixed shape, unlike bincount
        offs = counts.cumsum(0)
        done = grouped_mm(swiglu(grouped_mm(rows, self.w1, offs), grouped_mm(rows, self.w3, offs)), self.w2, offs)
        done = done * weights.reshape(-1).index_select(0, order).to(done.dtype).unsqueeze(1)
        return tokens.new_zeros(tokens.shape).index_add(0, source, done)


class MoEFeedForward(nn.Module):
    """Top-k routing (Shazeer et al. 2017, arXiv:1701.06538) to GroupedExperts, plus shared experts;
    see [Note: static dispatch], and [Note: dropless routing] for RoutedExperts."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.num_experts, self.top_k = config.num_experts, config.experts_per_token
        self.capacity_factor, self.aux_loss_coef = config.capacity_factor, config.router_aux_loss_coef
        self.normalize_top_k, self.dropless = config.normalize_top_k, config.dropless
        self.router = nn.Linear(h, config.num_experts, bias=False)
        experts = RoutedExperts if config.dropless else GroupedExperts
        self.experts = experts(config.num_experts, h, f, config.num_layers)
        self.shared_experts = None
        if config.num_shared_experts:
            shared = dataclasses.replace(config, ffn_hidden_size=f * config.num_shared_experts)
            self.shared_experts = LlamaMLP(shared)  # n shared experts = one MLP n times as wide (DeepSeekMoE)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        E, k = self.num_experts, self.top_k
        probs = self.router(x).float().softmax(dim=-1)  # (b, s, E)
        weights, chosen = probs.topk(k, dim=-1)  # (b, s, k)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen = chosen.flatten(1)  # (b, s*k), token-major
        picks = torch.zeros(b, s * k, E, dtype=torch.int32, device=x.device).scatter_(2, chosen.unsqueeze(2), 1)
        if self.dropless:
            out = self.experts(x.reshape(b * s, h), chosen.view(b * s, k), weights.reshape(b * s, k))
            return self._finish(x, out.view(b, s, h), picks, probs)
        return self._finish(x, self._through_capacity(x, chosen, weights, picks), picks, probs)

    def _through_capacity(self, x: Tensor, chosen: Tensor, weights: Tensor, picks: Tensor) -> Tensor:
        """The experts' weighted outputs (b, s, h) of the tokens `x` holds of each sequence, each
        expert taking at most `expert_capacity` of them ([Note: static dispatch]; [Note: capacity
        under context parallelism]); `chosen` (b, s*k) and `picks` (b, s*k, E) token-major, `weights`
        (b, s, k)."""
        b, s, h = x.shape
        E, k = self.num_experts, self.top_k
        capacity = expert_capacity(s, k, E, self.capacity_factor)
        place = ((picks.cumsum(1) - 1) * picks).sum(2)  # each pick's place in its expert's queue
        slot = torch.where(place < capacity, chosen * capacity + place, E * capacity)  # dropped -> spare slot
        index = slot.unsqueeze(2).expand(b, s * k, h)
        tokens = x.unsqueeze(2).expand(b, s, k, h).reshape(b, s * k, h)
        buffer = x.new_zeros(b, E * capacity + 1, h).scatter_add(1, index, tokens)
        grouped = buffer[:, :-1].reshape(b, E, capacity, h).transpose(0, 1).reshape(E, b * capacity, h)
        done = self.experts(grouped).reshape(E, b, capacity, h).transpose(0, 1).reshape(b, E * capacity, h)
        done = torch.cat([done, done.new_zeros(b, 1, h)], dim=1).gather(1, index)  # the spare slot gives 0
        return (done.view(b, s, k, h) * weights.to(done.dtype).unsqueeze(3)).sum(dim=2)

    def _finish(self, x: Tensor, out: Tensor, picks: Tensor, probs: Tensor) -> Tensor:
        """The shared experts and the load-balancing loss; `picks` (b, s*k, E) one-hot, token-major."""
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.aux_loss_coef:
            # Switch Transformer's load-balancing loss (arXiv:2101.03961 Eq. 4-6), per sequence:
            # E * sum_e f_e * P_e with f_e the share of the sequence's picks routed to e (not
            # differentiable) and P_e its mean router probability; averaged over sequences.
            # Under context parallelism f_e counts the picks of the whole sequence: summed over the
            # ranks holding its other chunks (graph/positions.py, as Megatron-LM's TopKRouter sums
            # tokens_per_expert over tp x cp); P_e stays this rank's, and the mean of the ranks'
            # losses (the dp average, cp folded in) is the whole sequence's.
            counts = picks.float().sum(dim=1)  # (b, E) and the picks made, summed in one collective
            counts = sum_over_sequence(torch.cat([counts, counts.new_full((picks.shape[0], 1), picks.shape[1])], dim=1))
            share = counts[:, :-1] / counts[:, -1:]
            balance = self.num_experts * (share * probs.mean(dim=1)).sum(dim=1).mean()
            out = attach_aux_loss(out, self.aux_loss_coef * balance)
        return out

    def sequence_split_refusal(self) -> str | None:
        """Why this layer's sequences cannot be split over a cp group (graph/positions.py): never. The
        load-balancing loss sums its counts over the sequence (`_finish`); the capacity is counted over
        the tokens a rank holds, as Megatron-LM counts it ([Note: capacity under context
        parallelism]; `sequence_split_note` says what that changes)."""
        return None

    def sequence_split_note(self) -> str | None:
        """What splitting this layer's sequences over a cp group changes (graph/positions.py), or
        None: with a capacity that drops tokens, which tokens it drops ([Note: capacity under context
        parallelism])."""
        whole = self.num_experts / self.top_k
        if self.dropless or self.capacity_factor >= whole:  # every token reaches its experts however split
            return None
        return (f"each cp rank counts its experts' capacity over the tokens it holds of each sequence, as "
                f"Megatron-LM does (ceil({self.capacity_factor:g} x tokens held x {self.top_k} / {self.num_experts}) "
                f"per expert), so it may drop other tokens than a run without cp; capacity_factor={whole:g} or "
                "dropless drops none")


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.moe = MoEFeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.mlp_norm(x))


class MoEModel(LlamaModel):
    """LlamaModel with MoELayer layers."""

    def __init__(self, config: MoEConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.tok_embeddings = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoELayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

