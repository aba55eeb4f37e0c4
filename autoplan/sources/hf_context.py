"""What a transformers model offers context parallelism: its position ids, and the attention it is
traced with.

Apart from hf.py (building models from configs) because it is one contract, context parallelism's
(runtime/parallel/context.py), and reaches into transformers' attention registry, which nothing else uses.

[Note: transformers under context parallelism]
Under cp each rank holds 2 of the 2 * cp chunks of every sequence (runtime/parallel/context.py), so a model
must compute with its tokens' true positions and attend to keys it does not hold. transformers
models say both through what they already take:

- positions: every causal LM's forward takes `position_ids`; the source traces the model with a
  `position_ids` input of value `arange(seq_len)` (an `InputTemplate` with `positions=True`), and
  the runtime cuts it to the rank's tokens like the token ids (partitioned.py `shard_sequence`), so
  rotary (or learned) position embeddings see the positions the tokens have in the whole sequence.
- attention: the model is built with the attention implementation `autoplan_causal`, registered
  in transformers' `AttentionInterface`: transformers' own SDPA forward without a mask. It has no entry in the
  mask interface (`AttentionMaskInterface`), so `create_causal_mask` returns None
  (masking_utils `_preprocess_mask_arguments`: "custom attention without equivalent mask
  creation"), and the SDPA forward then calls `scaled_dot_product_attention(..., is_causal=True)`
  with no mask. Without it, a traced model carries the (S x S) mask transformers writes out from
  the local length and the position ids (a packed-sequence mask once the local positions jump),
  which is wrong for a rank's chunks. The runtime routes the traced graph's SDPA through its
  gathered, chunked attention (runtime/parallel/context.py).

Attention SDPA cannot compute goes through autoplan's attention operator instead
(models/windowed_attention.py, `autoplan::attention`): logits soft-capped (Gemma 2's
`attn_logit_softcapping`, passed as `softcap`), a sliding window shorter than the model's position
limit (the `sliding_window` each layer passes: Gemma 2/3 and GPT-OSS per `layer_types`, Mistral,
Qwen2 with `use_sliding_window`), or attention sinks (GPT-OSS's `s_aux`, one logit per head that
joins the softmax's denominator). Because the cp runtime gathers the whole sequence's keys and
values, each of these is a different computation per local chunk at a known position, and the
runtime routes the operator as it routes SDPA; under tp its sharding rule gives every rank its
heads (the sinks' too). Whether a layer takes the operator is decided from the config (a window is
compared with `max_position_embeddings`, not with the traced length, which under cp is a rank's
share), so a model without any of the three keeps SDPA.

The implementation is used for every plan of a model that offers cp (cp 1 too), so `suggest` and
`run` trace the same graph; a model is not offered it (`context_parallel_refusal`), and keeps
transformers' own attention, where no causal mask in true positions describes its attention: an
encoder-decoder, a two-sided window (Gemma 3's `use_bidirectional_attention`), or attention dropout
with the operator (which has none).

A mixture of experts (Mixtral, Qwen2/3-MoE, DeepSeek-V3) routes each token to its experts with no
capacity, so a rank's chunks are routed as the whole sequence's tokens would be (hf.py
`routes_tokens_alone`, which lifts graph/positions.py's refusal of experts that count over a
sequence). What such a model counts over the batch is its routers' load-balancing loss, returned
with `output_router_logits=true` (transformers' `load_balancing_loss_func`: the product of the
share of picks and the mean router probability per expert, each a mean over every token of the
batch): the source computes it again with the share summed over the cp group (hf_loss.py
`balance_loss`), where the modeling code's own function gives the same number; a model whose router
loss is something else is not offered cp.
"""

from __future__ import annotations

import inspect
from typing import Any

from autoplan.sources.hf_loss import computes_balance_loss, recomputes_balance_loss

__all__ = ["ATTENTION", "context_parallel_refusal", "use_context_attention"]

ATTENTION = "autoplan_causal"
"""The attention implementation a model offering cp is built with (see the note)."""


def _window_bites(window: Any, limit: Any) -> bool:
    """Whether a sliding window of `window` tokens is shorter than the positions a model takes."""
    return isinstance(window, int) and (not isinstance(limit, int) or window < limit)


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
               scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any):
    """transformers' SDPA attention (integrations/sdpa_attention.py) without a mask; with logit
    soft-capping, a sliding window or sinks, autoplan's attention operator (models/windowed_attention.py).
    Grouped-query keys and values are repeated to the query heads, as transformers does when it
    passes a mask: without one it would call the kernel with `enable_gqa`, which the tensor-parallel
    analysis (graph/data_flow.py) does not follow, so attention would be left unsharded under tp.
    Under cp this gathers the repeated heads (num_rep times the bytes of Llama 3's gather, which
    gathers before the repeat)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    if query.shape[1] != key.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, rep), repeat_kv(value, rep)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Decided from the config, not the traced length: a cp plan traces at a rank's share of the
    # sequence, which a window may outlast while it bites on the whole sequence.
    window = kwargs.get("sliding_window")
    if not _window_bites(window, getattr(getattr(module, "config", None), "max_position_embeddings", None)):
        window = None
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=causal and query.shape[2] > 1)
        return out.transpose(1, 2).contiguous(), None
    from autoplan.models.windowed_attention import attention

    if dropout or (window is not None and not causal):
        raise RuntimeError(f"{type(module).__name__}: {'attention dropout' if dropout else 'a two-sided window'} "
                           f"with soft-capping, a sliding window or sinks cannot run as {ATTENTION}; "
                           f"{'set attention_dropout=0' if dropout else 'plan this model with --cp 1'}")
    out = attention(query, key, value, sinks=sinks, scale=scaling, causal=causal, window=window, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def use_context_attention(config: Any) -> None:
    """Build `config`'s model with the `autoplan_causal` attention (registered on first use)."""
    from transformers import AttentionInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, _attention)
    config._attn_implementation = ATTENTION


def _is_causal_lm(config: Any, model_class: type) -> bool:
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, ())
    return model_class.__name__ in ((names,) if isinstance(names, str) else tuple(names))


_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "attention"})
"""Layer kinds (a config's `layer_types` / `layers_block_type`) that are attention, which the runtime
splits over the cp group; any other (linear attention, state-space, convolution) mixes the sequence
its own way."""


def _computes_more_than_sdpa(config: Any) -> bool:
    """Whether some layer soft-caps its logits, attends over a window shorter than the model's
    positions, or (GPT-OSS) has sinks: what `_attention` hands to autoplan's attention operator."""
    window = getattr(config, "sliding_window", None)
    return (getattr(config, "attn_logit_softcapping", None) is not None or config.model_type == "gpt_oss"
            or (_window_bites(window, getattr(config, "max_position_embeddings", None))
                and getattr(config, "use_sliding_window", True) is not False))


def context_parallel_refusal(config: Any, model_class: type) -> str | None:
    """Why the model cannot be split over a cp group (one line naming the fix), or None."""
    name = model_class.__name__
    if getattr(model_class, "main_input_name", "input_ids") != "input_ids":
        return f"{name} takes no token sequence"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder, whose cross-attention context parallelism does not split"
    if not _is_causal_lm(config, model_class):
        return f"{name} is not a causal language model (context parallelism here splits causal self-attention)"
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        return f"{name}.forward takes no position_ids, so it cannot be told its tokens' positions"
    if not getattr(model_class, "_supports_attention_backend", False):
        return f"{name} does not compute attention through transformers' AttentionInterface"
    if getattr(config, "use_bidirectional_attention", False):
        return (f"{name} is built with use_bidirectional_attention=true, whose two-sided window autoplan's "
                "attention does not compute; plan it with --cp 1")
    if getattr(config, "attention_dropout", 0.0) and _computes_more_than_sdpa(config):
        return (f"{name} has attention_dropout={config.attention_dropout} with soft-capping, a sliding window or "
                "sinks, which autoplan's attention does not compute; set attention_dropout=0 or plan it with --cp 1")
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or ()
    others = sorted({str(kind) for kind in kinds if str(kind) not in _ATTENTION_LAYERS})
    if others:
        return (f"{name} has layers that are not attention ({', '.join(others)}), which mix a sequence's tokens "
                "without the attention context parallelism splits; plan it with --cp 1")
    if (getattr(config, "output_router_logits", False) and computes_balance_loss(model_class)
            and not recomputes_balance_loss(config, model_class)):
        return (f"{name} is built with output_router_logits=true, and its router loss is not the Switch "
                "load-balancing loss autoplan computes over the cp group; a batch-wide router loss computed over a "
                "rank's part of each sequence would differ; set output_router_logits=false or plan it with --cp 1")
    return None
