"""What each software stack's runtime keeps for the backward: activation bytes per token of a layer and
of the loss, by stack name (calibration.py [Note: software stacks]).

[Note: memory per stack]
A block's saved-for-backward bytes come from the profile (cost/memory.py [Note: activations]): what
autoplan's own runtime keeps when it runs the profiled module. A run of another stack runs another
implementation of the same layer, which keeps other tensors: priced with the profile's bytes,
torchtitan's Llama 3.1 runs (benchmarks/data/published_memory.json) were predicted at 0.68x to 2.4x
their published peaks (benchmarks/results/validate_memory.txt, "before"), in both directions by far
more than any allowance. So a named stack that states its own layer replaces the profile's bytes
for the blocks it describes, counted from the layer's shapes (not from today's zoo layer, which
changes as autoplan's runtime does); every other block, and every stack not named here (the
default `flash`, autoplan's runtime), keeps the profile's bytes.

Which blocks: a dense Llama-style layer (RMSNorm, grouped-query attention with rotary embeddings,
SwiGLU MLP; no biases), recognized from its parameter count, h the hidden size, d_kv = kv heads x
head size: 2 h (norms) + 2 h^2 (q, o) + 2 h d_kv (k, v) + 3 h f (the MLP), so f = (params - 2 h -
2 h^2 - 2 h d_kv) / 3 h must be a whole number; and the head (the output projection with the loss).
Anything else (a GPT layer, a mixture-of-experts layer) keeps the profile.

Per token, e bytes an element in the compute dtype (2 in bf16), in two parts: tensors every tp rank
keeps whole (hidden-shaped tensors without sequence parallelism; under torchtitan's sequence
parallelism also the all-gathered inputs of the projections) and the rest (split over tp).

- `torchtitan` (pytorch/torchtitan at 9dec370ad26b, the commit of its Llama 3.1 H100 benchmarks;
  torchtitan/models/llama/model.py):
  - no recompute: each norm keeps its input (e h; the fused kernel also an fp32 rstd a row) and its
    output is kept by the projections that read it (e h): 4 e h hidden-shaped for the two. That is the
    fused RMSNorm: torchtitan's Triton `fused_rmsnorm` (the `norm_type` of its April 2024 Llama 2 13B and
    Llama 3 8B configs, train_configs/*.toml at 0413364, whose runs are in modern_runs.json) and
    `nn.RMSNorm` on CUDA since 2025 (torchtitan/models/llama3/model.py at e7c0cae; cost/memory.py
    [Note: fused RMSNorm]). Its Python `RMSNorm` of late 2024 (`norm_type = "rmsnorm"`, norms.py at
    9dec370: `self._norm(x.float()).type_as(x) * self.weight`) keeps an fp32 copy more, 4 h a norm;
    every collected run that used it recomputed its layers, which keeps no norm. `apply_rotary_emb`'s
    complex products save nothing (`freqs_cis` is a buffer, so autograd keeps only it); its bf16 q is
    SDPA's input (e h); `repeat_kv` materializes k and v at the query heads when there are fewer key
    heads (2 e h; else k and v themselves, 2 e d_kv); SDPA's output (e h) and log-sum-exp (4 fp32 per
    head); the `.contiguous()` copy of the transposed output that `wo` saves (e h);
    `w2(F.silu(w1(x)) * w3(x))` saves w1's output, silu's output, w3's output and their product (4 e f).
  - selective (`selective_ac_option = "op"`, torchtitan/parallelisms/parallelize_llama.py `_save_list`):
    a checkpoint per layer keeping its input (e h, hidden-shaped) and the outputs of every second
    `mm` (the 1st, 3rd, 5th and 7th of wq, wk, wv, wo, w1, w3, w2: q, v, w1's and w2's outputs: e (2 h
    + d_kv + f)) and of the flash-attention kernel (e h and the log-sum-exp); the rest is recomputed.
  - the loss (train.py at 9dec370): `cross_entropy(pred.flatten(0, 1).float(), labels)` keeps the
    fp32 log-softmax of the logits (4 V a token, V the vocabulary, split over tp under torchtitan's
    loss parallelism), besides the output projection's input (e h). Its backward holds the log-softmax,
    NLL's dense fp32 gradient and the log-softmax's gradient together: twice the saved bytes more,
    which is `head_backward_bytes` (cost/memory.py); under tp, loss parallelism's backward holds three
    times them more (`loss_backward_factor`). The bf16 logits are deleted before the backward
    (`del pred`).
- `megatron-core`, `megatron-core-deepep` (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", Sec. 4.1, per-layer count 34 sbh, adapted to a Llama layer with
  flash attention (no s x s scores), no dropout, grouped-query attention and SwiGLU): norm and linear
  inputs of attention and MLP 4 e h (hidden-shaped); q (e h), k and v (e d_kv each), the attention
  output (e h); the fused SwiGLU keeps fc1's output (2 e f) and its own output (e f) (Megatron-Core
  `bias_swiglu_impl`). Selective recompute ("core_attn") recomputes the attention kernel, which with
  flash attention saves nothing of its own: the same bytes. Its loss keeps the profile's. No collected
  row measures a Megatron-Core dense run yet, so this count is cited, not validated.
- `megatron-lm-2023` (Megatron-LM's `pretrain_gpt.py` with `--use-flash-attn --swiglu
  --use-distributed-optimizer --bf16` and its argument defaults of 2023, the runs of NVIDIA/Megatron-LM
  pull request #482, docs/published-memory.md): the layer above plus one-byte dropout masks. Its
  `--hidden-dropout` defaults to 0.1 (megatron/arguments.py `_add_regularization_args`), and
  `bias_dropout_add_fused_train` (megatron/model/transformer.py) runs F.dropout after the attention's
  and the MLP's output projections, each keeping a bool mask of the hidden shape (Korthikanti et al.
  2022, Sec. 4.1, count them: the "sbh" of each of the two dropout masks in 34 sbh); the attention's own
  dropout runs inside the flash kernel, which keeps only its RNG state. Its loss is
  `vocab_parallel_cross_entropy(output.float(), labels)` (megatron/model/gpt_model.py
  `post_language_model_processing`; megatron/core/tensor_parallel/cross_entropy.py): the softmax is
  computed in place in the fp32 copy of the logits and saved (4 V / tp bytes a token), the bf16 logits
  are freed; the output projection keeps its input (e h, whole without sequence parallelism, where
  Megatron's linears save the un-gathered input and gather it again in the backward). The backward
  edits the saved softmax in place into the gradient and `.float()`'s backward casts it to bf16:
  half the saved bytes more (`loss_backward_factor` 0.5).

- `torchtitan-2025-compile` (torchtitan at e7c0cae, June 2025, run with `--training.compile`: the Trainy
  H200 rows): the layer as `torchtitan`'s, compiled per TransformerBlock (`compiled_layers`). Under the
  selective policy, inductor's partitioner (torch/_functorch/partitioners.py) keeps what the policy
  marks MUST_SAVE only where the backward reads it, and no backward reads w2's output (the residual
  add's backward does not): the compiled layer keeps the eager count less that output (e h a token).
  Measured on this machine with torch 2.13's inductor on a layer of torchtitan's shape (norms, GQA, SwiGLU
  under `_save_list`'s every-second-mm policy; tests/test_memory_rows_issue40.py): eager count 3,744
  bytes a token, compiled 3,232 = 3,744 - e h (h 256). Only at tp 1 (a DTensor layer under compile is not
  checked; under tp the eager count stays, high); without recompute the eager count stays too (compile
  also fuses the SwiGLU's and the norms' saved tensors there, not measured, so the prediction stays
  high). The loss is compiled: torchtitan/components/loss.py at e7c0cae,
  `build_cross_entropy_loss`, wraps `cross_entropy(pred.flatten(0, 1).float(), labels)` in
  `torch.compile` when `training.compile` is set (at 9dec370 that line is commented out in train.py).
  Inductor's min-cut partitioner (torch/_functorch/partitioners.py `min_cut_rematerialization_partition`)
  recomputes the fp32 cast and the log-softmax in the backward, so the loss saves the bf16 logits and two
  fp32 numbers a token (the row maximum and the log-sum-exp: e V + 8 bytes a token, against 4 V eager),
  and its backward is one fused kernel writing the bf16 gradient of the logits (e V; `loss_backward_factor`
  1). Measured on this machine with torch 2.13's inductor (tests/test_memory_rows_issue40.py: the saved
  tensors through `saved_tensors_hooks`, and the backward's one logits-sized bf16 buffer in its output
  code). Only at tp 1: loss parallelism's DTensor loss under compile is not checked, so at tp > 1 it
  keeps `torchtitan`'s fp32 count (high).

Pipeline outputs (`pipeline_outputs`): torch.distributed.pipelining's stage keeps each micro-batch's
forward output in `output_chunks` until the next step, to merge them for the caller
(torch/distributed/pipelining/stage.py `forward_one_chunk`). Before pytorch/pytorch#153383 (merged May
2025) every stage appended its output ("all"); since then only the last stage does ("last"), whose output
is the logits (bf16, split over the vocabulary under loss parallelism: `ColwiseParallel(output_layouts=
Shard(-1), use_local_output=False)` on `output` in torchtitan's TP plan), kept for every micro-batch of the
step (pytorch/pytorch#159251, July 2025, asks to make this optional). pytorch/pytorch#138504 (Oct 2024)
detaches them, so they hold their storage, not the graph. A non-last stage's output is the last layer's
output, sequence-split under torchtitan's sequence parallelism (`w2`'s `RowwiseParallel(output_layouts=
Shard(1))`). `torchtitan` (torch 1963fc8, Dec 2024) keeps "all"; `torchtitan-2025-compile` (torch
2.8.0a0+5228986c39 of 2025-05-29) "last"; every other stack none counted (`pipeline_output_bytes`).

Counted as the profile counts a block: per batch of the profile (`ModelProfile.batch_size` x
`seq_len` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.config import ParallelConfig
from autoplan.graph.blocks import Block, ModelProfile

__all__ = ["STACK_MEMORY", "StackMemory", "dense_llama_ffn", "loss_backward_factor", "pipeline_output_bytes",
           "stack_keeps_profile", "stack_memory", "stack_saved_bytes"]


@dataclass(frozen=True)
class StackMemory:
    """How one stack's runtime keeps activations ([Note: memory per stack])."""

    name: str
    layer: str
    """"profile" (the profiled module's bytes), "torchtitan" or "megatron-core"."""
    loss: str
    """"profile", "fp32-log-softmax" (a full fp32 log-softmax of the logits saved for the backward, torchtitan),
    "compiled-ce" (torchtitan's loss under torch.compile: the bf16 logits and two fp32 numbers a token; at
    tp > 1 counted as "fp32-log-softmax") or "vocab-parallel-ce" (Megatron's fp32 softmax, edited in place
    by its backward)."""
    dropout_masks: int = 0
    """One-byte dropout masks of the hidden shape a layer keeps (Megatron-LM's default hidden dropout)."""
    compiled_layers: bool = False
    """Layers run under torch.compile: under selective recompute, a saved output the backward never
    reads (w2's) is not kept ([Note: memory per stack], torchtitan-2025-compile)."""
    pipeline_outputs: str = "none"
    """Which pipeline stages keep every micro-batch's forward output until the step ends: "all", "last"
    or "none" ([Note: memory per stack], pipeline outputs)."""


STACK_MEMORY: dict[str, StackMemory] = {
    "torchtitan": StackMemory("torchtitan", layer="torchtitan", loss="fp32-log-softmax", pipeline_outputs="all"),
    "torchtitan-2025-compile": StackMemory("torchtitan-2025-compile", layer="torchtitan", loss="compiled-ce",
                                           compiled_layers=True, pipeline_outputs="last"),
    "megatron-core": StackMemory("megatron-core", layer="megatron-core", loss="profile"),
    "megatron-core-deepep": StackMemory("megatron-core-deepep", layer="megatron-core", loss="profile"),
    "megatron-lm-2023": StackMemory("megatron-lm-2023", layer="megatron-core", loss="vocab-parallel-ce",
                                    dropout_masks=2),
}
"""Stacks whose runtime's activations differ from the profiled module's; every other name (the
default `flash`, autoplan's runtime) keeps the profile's bytes."""

_PROFILE = StackMemory("profile", layer="profile", loss="profile")


def stack_memory(name: str | None) -> StackMemory:
    """The activation accounting of stack `name` (None or a stack not listed: the profile's)."""
    return STACK_MEMORY.get(name or "", _PROFILE)


def stack_keeps_profile(name: str | None) -> bool:
    """Whether stack `name` keeps the profile's bytes for every block (`stack_saved_bytes` is None for
    each): the default stack and any not listed. Lets the search skip the per-block question."""
    how = stack_memory(name)
    return how.layer == "profile" and how.loss == "profile"


def dense_llama_ffn(profile: ModelProfile, block: Block) -> int | None:
    """The MLP width f of a dense Llama-style layer, from its parameters; None for any other block
    ([Note: memory per stack])."""
    h, heads = profile.hidden_size, profile.num_heads
    if block.kind != "layer" or not h or not heads or h % heads:
        return None
    experts = (profile.extra.get("experts") or {}).get("block_params")
    if experts and any(experts):
        return None
    d_kv = (profile.num_kv_heads or heads) * (h // heads)
    rest = block.num_params - 2 * h - 2 * h * h - 2 * h * d_kv
    if rest <= 0 or rest % (3 * h):
        return None
    return rest // (3 * h)


def _item(dtype: str) -> int:
    return 4 if dtype in ("float32", "fp32") else 2


def _per_gpu(tokens: int, whole: float, split: float, tp: int) -> float:
    """Bytes on one GPU of `whole` bytes a token every tp rank keeps and `split` bytes a token split over tp."""
    return tokens * (whole + split / tp)


def stack_saved_bytes(stack: str | None, profile: ModelProfile, block: Block, cfg: ParallelConfig) -> float | None:
    """Saved bytes of `block` on one GPU per batch of the profile (before `ParallelConfig.batch_share`)
    under `stack`, at cfg's tp, sequence parallelism and recompute ("none" or "selective"; under full
    recompute a layer keeps its input whatever the stack), or None where the stack keeps what the
    profile measured ([Note: memory per stack])."""
    how = stack_memory(stack)
    tokens = profile.batch_size * profile.seq_len
    e = _item(profile.dtype)
    h = profile.hidden_size or 0
    tp, sp = cfg.tp, cfg.sequence_parallel and cfg.tp > 1
    if block.kind == "head" and how.loss == "compiled-ce" and tp == 1 and profile.vocab_size:
        # The projection's input and what the compiled loss saves: the bf16 logits, a row maximum and
        # a log-sum-exp in fp32 ([Note: memory per stack], torchtitan-2025-compile).
        return _per_gpu(tokens, e * h + e * profile.vocab_size + 8.0, 0.0, 1)
    if block.kind == "head" and how.loss in ("fp32-log-softmax", "compiled-ce") and profile.vocab_size:
        # The projection's input: whole on every tp rank (colwise, its input gathered); the log-softmax
        # split over the vocabulary (loss parallelism).
        return _per_gpu(tokens, e * h, 4.0 * profile.vocab_size, tp)
    if block.kind == "head" and how.loss == "vocab-parallel-ce" and profile.vocab_size:
        # The projection's input, split under sequence parallelism (Megatron saves it un-gathered);
        # the fp32 softmax split over the vocabulary.
        return _per_gpu(tokens, 0.0 if sp else e * h, 4.0 * profile.vocab_size + (e * h if sp else 0.0), tp)
    if how.layer == "profile" or cfg.recompute == "full":
        return None
    f = dense_llama_ffn(profile, block)
    if f is None:
        return None
    heads = profile.num_heads or 1
    d_kv = (profile.num_kv_heads or heads) * (h // heads)
    lse = 4.0 * heads
    if how.layer == "torchtitan":
        # Under sequence parallelism (torchtitan's TP plan: SequenceParallel norms) the norms' tensors
        # are split, and the all-gathered inputs of the attention and MLP projections (e h each) are
        # kept whole by the linears that save them; the row-parallel w2's output is a whole partial
        # sum before its reduce-scatter.
        if cfg.recompute == "selective":
            # The layer's input, q, v, w1's output, the attention's output and log-sum-exp, and w2's
            # output (the 7th mm: a whole partial sum under tp) unless compiled at tp 1, which drops it.
            w2_out = 0 if how.compiled_layers and tp == 1 else e * h
            kept_whole = (e * h if not sp else 0) + (w2_out if tp > 1 else 0)
            split = e * (h + d_kv + f) + e * h + lse + (w2_out if tp == 1 else 0) + (e * h if sp else 0)
            return _per_gpu(tokens, kept_whole, split, tp)
        kv = h if (profile.num_kv_heads or heads) < heads else d_kv
        norms = 4 * e * h
        other = e * h + 2 * e * kv + e * h + lse + e * h + 4 * e * f
        if sp:  # the norms' inputs split, their outputs gathered whole for the projections
            return _per_gpu(tokens, 2 * e * h, 2 * e * h + other, tp)
        return _per_gpu(tokens, norms, other, tp)
    # megatron-core: sequence parallelism splits everything (Korthikanti et al. 2022, Sec. 4.2.2).
    hidden, other = 4 * e * h + how.dropout_masks * h, e * (2 * h + 2 * d_kv) + lse + 3 * e * f
    return _per_gpu(tokens, 0.0, hidden + other, tp) if sp else _per_gpu(tokens, hidden, other, tp)


def loss_backward_factor(stack: str | None, tp: int) -> float:
    """How many times the loss's saved bytes its backward allocates on top of them (`head_backward_bytes`
    in cost/memory.py). 2 by default: the gradient of the log-softmax's output and its own gradient.
    torchtitan under tp (loss parallelism, torch/distributed/tensor/parallel/loss.py
    `_nll_loss_and_log_softmax_backward`: `(grad_input + torch.exp(x)) * grad_output`, fp32 tensors of
    the logits' shape) holds three: the dense NLL gradient, exp(x) and their sum before the product.
    Megatron's vocab-parallel cross entropy: 0.5. torchtitan's compiled loss at tp 1: 1."""
    loss = stack_memory(stack).loss
    if loss == "compiled-ce":
        # One fused backward kernel writes the bf16 gradient of the logits: once the saved bf16 logits
        # (tp 1); under tp counted as the eager loss ([Note: memory per stack]).
        if tp == 1:
            return 1.0
        loss = "fp32-log-softmax"
    if loss == "vocab-parallel-ce":
        # Megatron's backward turns the saved softmax into the gradient in place; `.float()`'s backward
        # casts it to the compute dtype: half the fp32 bytes ([Note: memory per stack]).
        return 0.5
    return 3.0 if loss == "fp32-log-softmax" and tp > 1 else 2.0


def pipeline_output_bytes(stack: str | None, profile: ModelProfile, cfg: ParallelConfig,
                          stage_ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> float:
    """Bytes one pipeline rank keeps for the forward outputs of every micro-batch of the step
    ([Note: memory per stack], pipeline outputs): the last stage's logits (bf16, the vocabulary split
    over tp) and, where the stack's torch keeps every stage's ("all"), each other stage's output
    (the last layer's output, split over tp under sequence parallelism). 0 without pp or for a stack
    that keeps none."""
    keep = stack_memory(stack).pipeline_outputs
    if keep == "none" or cfg.pp < 2 or cfg.num_microbatches < 1:
        return 0.0
    f = cfg.batch_share(profile.batch_size)
    tokens = profile.batch_size * profile.seq_len * f
    e = _item(profile.dtype)
    out = 0.0
    for a, b in stage_ranges:
        if b <= a:
            continue
        if any(profile.blocks[i].kind == "head" for i in range(a, b)):
            if profile.vocab_size:
                out += tokens * e * profile.vocab_size / cfg.tp
        elif keep == "all" and b - 1 < len(profile.cuts):
            split = cfg.tp if cfg.sequence_parallel and cfg.tp > 1 else 1
            out += profile.cuts[b - 1].num_bytes * f / split
    return out * cfg.num_microbatches
