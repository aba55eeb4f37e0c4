"""The plans every export target is checked on (issue 15): one per feature a target may or may not
state. Each is a real `autoplan.suggest` result with the pins that produce the case; `CASES[name]()`
returns the plan (cached)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import autoplan

# A small Llama (GQA, untied embeddings) whose head is heavy enough (128k vocabulary) that the
# planner gives the output layer (with the final norm: search/context.py [Note: final norm with
# the head]) a stage of its own: no transformer layer on the last stage at pp = 4.
LLAMA = "llama:num_layers=8,hidden_size=512,num_heads=8,num_kv_heads=4,vocab_size=128000,max_seq_len=512"
SMALL_LLAMA = "llama:num_layers=12,hidden_size=256,num_heads=4,num_kv_heads=2,vocab_size=32000,max_seq_len=512"
GPT = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=256"


def _suggest(model: str, cluster: str, global_batch: int, seq_len: int, **pins):
    return autoplan.suggest(model, cluster, global_batch=global_batch, seq_len=seq_len, **pins)[0]


CASE_PINS: dict[str, tuple[str, str, int, int, dict]] = {
    # (model, cluster, global batch, sequence length, pins)
    "default": (SMALL_LLAMA, "1x8xA100-80GB", 32, 512, {}),
    "preset-llama3-8b": ("llama3-8b", "1x8xH100-80GB", 32, 2048, dict(tp=1, pp=1, zero=2)),  # FSDP2 over 8
    "interleaved-uneven": (SMALL_LLAMA, "1x4xA100-80GB", 16, 512,
                           dict(pp=2, dp=2, tp=1, schedule="interleaved-1f1b", virtual_stages=3, zero=1)),
    "zb-h1": (SMALL_LLAMA, "1x4xA100-80GB", 16, 512, dict(pp=4, tp=1, dp=1, schedule="zb-h1")),
    "zero2": (SMALL_LLAMA, "1x8xA100-80GB", 32, 512, dict(pp=2, tp=1, dp=4, zero=2, schedule="1f1b")),
    "selective-sp": (SMALL_LLAMA, "1x8xA100-80GB", 32, 512,
                     dict(tp=2, pp=2, dp=2, recompute="selective", sequence_parallel=True, schedule="1f1b")),
    "empty-last-stage": (LLAMA, "1x4xA100-80GB", 16, 512,
                         dict(pp=4, tp=1, dp=1, schedule="1f1b", micro_batch_size=1)),
    "pp1-many-microbatches": (SMALL_LLAMA, "1x2xA100-80GB", 64, 512, dict(pp=1, tp=1, dp=2, micro_batch_size=1)),
    "tp-zero0": (SMALL_LLAMA, "1x8xA100-80GB", 32, 512, dict(tp=2, pp=2, dp=2, zero=0, schedule="1f1b")),
    "gpt": (GPT, "1x4xA100-80GB", 16, 256, dict(pp=2, tp=1, dp=2, schedule="1f1b")),
    # DeepSpeed's AutoTP (tp > 1 without a pipeline): its batch count includes the tp ranks (issue 29).
    "autotp": (SMALL_LLAMA, "1x8xA100-80GB", 32, 512, dict(tp=2, pp=1, dp=4, zero=0, sequence_parallel=False)),
    # 2 micro-batches on 4 stages: torch's Schedule1F1B refuses fewer micro-batches than stages (issue 29).
    "1f1b-few-microbatches": (SMALL_LLAMA, "1x4xA100-80GB", 2, 512,
                              dict(pp=4, tp=1, dp=1, schedule="1f1b", micro_batch_size=1)),
}


FIXED_CUTS: dict[str, tuple[int, ...]] = {
    # How an uneven interleaved cutting is written is what this case checks; which uneven cutting the
    # planner picks follows the calibration's tie-breaks, so the case fixes one (6 stages of 15 blocks:
    # ranks hold 3 + 2 + 2 and 3 + 3 + 2 blocks, the final norm with the head).
    "interleaved-uneven": (0, 3, 6, 8, 11, 13, 15),
}


def with_cuts(plan, boundaries):
    """`plan` with its stages cut at `boundaries` (block indices), names following the cuts."""
    names = plan.block_names
    stages = tuple(dataclasses.replace(s, first_block=a, end_block=b, first_block_name=names[a],
                                       last_block_name=names[b - 1])
                   for s, (a, b) in zip(plan.stages, itertools.pairwise(boundaries), strict=True))
    return dataclasses.replace(plan, stages=stages)


@functools.cache
def case(name: str):
    model, cluster, global_batch, seq_len, pins = CASE_PINS[name]
    plan = _suggest(model, cluster, global_batch, seq_len, **pins)
    return with_cuts(plan, FIXED_CUTS[name]) if name in FIXED_CUTS else plan


CASES = tuple(CASE_PINS)
