"""Issue 40's memory rows: what torchtitan's compiled loss saves (measured here with inductor) and the
pipeline outputs torch's pipelining keeps (cost/memory_stacks.py [Note: memory per stack]), checked
through `autoplan.suggest` and benchmarks/validate_memory.py's rows."""

from __future__ import annotations

import pytest
import torch

import autoplan
from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory_stacks import loss_backward_factor, pipeline_output_bytes, stack_saved_bytes
from tests._scripts import load_benchmark

vm = load_benchmark("validate_memory")
GIB = 2**30


def _loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # torchtitan/components/loss.py at e7c0cae, `cross_entropy_loss`
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def _saved_bytes(fn, pred, labels) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(pred, labels)
    loss.backward()
    return sum(seen.values())


@pytest.mark.extended  # inductor compiles a C++ kernel: 20-70 s on a loaded 2-core machine
@pytest.mark.filterwarnings("ignore")
def test_compiled_loss_saves_the_bf16_logits_not_an_fp32_log_softmax():
    """The stack `torchtitan-2025-compile` counts the compiled loss as saving e V + 8 bytes a token
    (bf16 logits, row max and log-sum-exp in fp32) against the eager loss's 4 V: measured with
    inductor on this machine, the eager loss's count with it."""
    tokens, vocab = 256, 2048
    pred = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    eager = _saved_bytes(_loss, pred, labels)
    torch._dynamo.reset()
    compiled = _saved_bytes(torch.compile(_loss, backend="inductor"), pred, labels)
    # eager: the fp32 log-softmax (its backward and NLL's keep the same tensor) and the labels
    assert tokens * (4 * vocab + 8) <= eager <= tokens * (4 * vocab + 8) + 64
    # compiled: the bf16 input, two fp32 numbers a token, the labels (and a scalar or two)
    assert tokens * (2 * vocab + 8 + 8) <= compiled <= tokens * (2 * vocab + 8 + 8) + 64


# A layer of torchtitan's shape (torchtitan/models/llama3/model.py at e7c0cae: RMSNorm, grouped-query
# attention, SwiGLU) at a size inductor compiles in about a minute here.
_H, _HEADS, _KV_HEADS, _FFN, _SEQ, _BATCH = 256, 8, 2, 768, 128, 2
_LAYER_SPEC = (f"llama:num_layers=2,hidden_size={_H},num_heads={_HEADS},num_kv_heads={_KV_HEADS},"
               f"ffn_hidden_size={_FFN},vocab_size=512,max_seq_len={_SEQ}")


class _TorchtitanLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        nn, hd = torch.nn, _H // _HEADS
        self.attention_norm, self.ffn_norm = nn.RMSNorm(_H), nn.RMSNorm(_H)
        self.wq, self.wo = nn.Linear(_H, _H, bias=False), nn.Linear(_H, _H, bias=False)
        self.wk, self.wv = nn.Linear(_H, _KV_HEADS * hd, bias=False), nn.Linear(_H, _KV_HEADS * hd, bias=False)
        self.w1, self.w3 = nn.Linear(_H, _FFN, bias=False), nn.Linear(_H, _FFN, bias=False)
        self.w2 = nn.Linear(_FFN, _H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hd, rep = _H // _HEADS, _HEADS // _KV_HEADS
        y = self.attention_norm(x)
        q = self.wq(y).view(b, s, _HEADS, hd)
        k = self.wk(y).view(b, s, _KV_HEADS, hd).repeat_interleave(rep, dim=2)
        v = self.wv(y).view(b, s, _KV_HEADS, hd).repeat_interleave(rep, dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        x = x + self.wo(o.transpose(1, 2).contiguous().view(b, s, _H))
        y = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(y)) * self.w3(y))


def _op_sac_policy():
    """torchtitan's `selective_ac_option = "op"` (parallelize_llama.py `_save_list`, `_custom_policy` at
    e7c0cae): save every second mm and the attention kernel (its CPU form here), recompute the rest."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        to_save = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _layer_profile():
    prof = vm._profile(_LAYER_SPEC, _SEQ)
    return prof, next(b for b in prof.blocks if b.kind == "layer")


def test_a_compiled_layer_under_selective_recompute_drops_w2s_output_from_the_count():
    prof, layer = _layer_profile()
    cfg = ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                         recompute="selective")
    eager = stack_saved_bytes("torchtitan", prof, layer, cfg)
    compiled = stack_saved_bytes("torchtitan-2025-compile", prof, layer, cfg)
    tokens = prof.batch_size * prof.seq_len
    assert eager - compiled == tokens * 2 * _H  # w2's output, bf16
    cfg8 = ParallelConfig(tp=8, pp=1, dp=1, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                          sequence_parallel=True, recompute="selective")
    # under tp (a DTensor layer under compile, not checked) the eager count stays
    assert stack_saved_bytes("torchtitan-2025-compile", prof, layer, cfg8) == \
        stack_saved_bytes("torchtitan", prof, layer, cfg8)


@pytest.mark.extended  # inductor compiles the layer's forward and backward: 80-150 s on a loaded 2-core machine
@pytest.mark.filterwarnings("ignore")
def test_a_compiled_layer_keeps_what_the_stack_counts_under_torchtitans_op_policy():
    """torch.compile of the layer under torchtitan's op-level selective checkpointing keeps, per token,
    exactly `stack_saved_bytes("torchtitan-2025-compile", ...)`: the checkpoint's input, q, v, w1's output,
    the attention's output and log-sum-exp, not w2's output, which no backward reads."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = _TorchtitanLayer().to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def run(x):
        return checkpoint(layer, x, use_reentrant=False, context_fn=_op_sac_policy)

    x = torch.randn(_BATCH, _SEQ, _H, dtype=torch.bfloat16, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch._dynamo.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(run, backend="inductor")(x)
    out.sum().backward()
    prof, block = _layer_profile()
    cfg = ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                         recompute="selective")
    per_token = stack_saved_bytes("torchtitan-2025-compile", prof, block, cfg) / (prof.batch_size * prof.seq_len)
    assert sum(seen.values()) / (_BATCH * _SEQ) == per_token  # 3,232 bytes a token here (eager count 3,744)


def _head_profile():
    prof = vm._profile("llama3-8b", 8192)
    head = next(b for b in prof.blocks if b.kind == "head")
    return prof, head


def test_stack_counts_for_the_compiled_loss():
    prof, head = _head_profile()
    tokens, h, vocab = prof.batch_size * prof.seq_len, prof.hidden_size, prof.vocab_size
    cfg = ParallelConfig(tp=1, pp=1, dp=8, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                        recompute="selective")
    assert stack_saved_bytes("torchtitan-2025-compile", prof, head, cfg) == tokens * (2 * h + 2 * vocab + 8)
    assert loss_backward_factor("torchtitan-2025-compile", 1) == 1.0
    # under tp (loss parallelism, not checked compiled) it keeps torchtitan's eager count
    cfg8 = ParallelConfig(tp=8, pp=1, dp=1, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                           sequence_parallel=True)
    assert stack_saved_bytes("torchtitan-2025-compile", prof, head, cfg8) == \
        stack_saved_bytes("torchtitan", prof, head, cfg8)
    assert loss_backward_factor("torchtitan-2025-compile", 8) == loss_backward_factor("torchtitan", 8)


def test_pipeline_outputs_per_stack():
    """torch before pytorch/pytorch#153383 keeps every stage's outputs ("all", stack torchtitan);
    since, the last stage's logits only; autoplan's own runtime none."""
    prof = vm._profile("llama3-8b", 8192)
    n = prof.num_blocks
    cfg = ParallelConfig(tp=2, pp=2, dp=2, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                        sequence_parallel=True)
    tokens = prof.batch_size * prof.seq_len * cfg.batch_share(prof.batch_size)
    logits = 4 * tokens * 2 * prof.vocab_size / 2
    first, last = [(0, n // 2)], [(n // 2, n)]
    assert pipeline_output_bytes("torchtitan", prof, cfg, last) == logits
    assert pipeline_output_bytes("torchtitan-2025-compile", prof, cfg, last) == logits
    cut = prof.cuts[n // 2 - 1].num_bytes * cfg.batch_share(prof.batch_size) / 2
    assert pipeline_output_bytes("torchtitan", prof, cfg, first) == 4 * cut
    assert pipeline_output_bytes("torchtitan-2025-compile", prof, cfg, first) == 0
    assert pipeline_output_bytes(None, prof, cfg, last) == pipeline_output_bytes("megatron-core", prof, cfg, last) == 0
    one_stage = ParallelConfig(tp=2, pp=1, dp=4, micro_batch_size=1, num_microbatches=4, schedule="1f1b")
    assert pipeline_output_bytes("torchtitan", prof, one_stage, [(0, n)]) == 0


def test_suggest_under_torchtitan_keeps_every_micro_batchs_logits_on_the_last_stage():
    """Through the public API: a pp 2 plan priced under `--stack torchtitan` holds the last stage's
    logits of all its micro-batches (8 here), which one micro-batch's loss alone is far below."""
    m, seq = 8, 2048
    plans = autoplan.suggest("llama3-8b", "1x8xH100-80GB", global_batch=4 * m, seq_len=seq, stack="torchtitan",
                             top=1, tp=1, pp=2, dp=4, micro_batch_size=1, recompute="full")
    assert plans
    last = plans[0].stages[-1]
    assert plans[0].num_microbatches == m
    logits = m * seq * 2 * 128256
    assert last.memory.activations_bytes >= logits


@pytest.mark.extended  # every row profiled and predicted: 20-50 s under load (the default tier's gate is
# tests/test_validate_memory.py)
def test_memory_rows_of_issue_40():
    """The 405B 1F1B row is no longer under; Trainy's two H200 rows counted with their 2025 runtime
    are no longer 1.5x; nothing under but the one known row."""
    rows = {r["id"]: r for r in vm.memory_rows()}
    assert rows["tt_h100_l31_405b_fsdp8_tp8_pp8_1f1b"]["ratio"] >= vm.UNDER_RATIO
    for rid in ("trainy_h200_l31_8b_fsdp32", "trainy_h200_l31_8b_fsdp64"):
        assert rows[rid]["stack"] == "torchtitan-2025-compile"
        assert vm.UNDER_RATIO <= rows[rid]["ratio"] <= 1.2
    assert [r for r, v in rows.items() if "UNDER" in v["flags"]] == list(vm.KNOWN_UNDER)
    assert not vm.gate_failures(list(rows.values()))


def test_search_speed_against_runs_both_checkouts_in_one_process(tmp_path, capsys, monkeypatch):
    """benchmarks/search_speed.py --against: the interleaved in-process A/B of two checkouts (issue 40's
    "no slower" figure). Against this same tree the two sides evaluate the same configurations."""
    import json
    from pathlib import Path

    ss = load_benchmark("search_speed")
    monkeypatch.setattr(ss, "CASES", [("gpt2-small", "1x8xA100-80GB", 16, 256)])
    root = str(Path(__file__).resolve().parents[1])
    rows = ss.compare(root, 1)
    out = capsys.readouterr().out
    assert "this / other: minima cpu" in out
    (row,) = rows
    assert row["about"]["this"] == row["about"]["other"]
    assert len(row["times"]["this"]) == len(row["times"]["other"]) == 2
    json.dumps(rows)  # what --json writes


def test_search_speed_bytecodes_counts_the_same_work_against_the_same_tree(capsys, monkeypatch):
    """benchmarks/search_speed.py --against PATH --bytecodes: a count the load does not change, so two
    checkouts of the same tree count exactly alike."""
    from pathlib import Path

    ss = load_benchmark("search_speed")
    monkeypatch.setattr(ss, "CASES", [("gpt2-small", "1x8xA100-80GB", 16, 256)])
    (row,) = ss.compare_bytecodes(str(Path(__file__).resolve().parents[1]))
    assert row["counts"]["this"] == row["counts"]["other"] and row["ratio"] == 1.0
    assert row["counts"]["this"]["bytecodes"] > 10_000 and "gpt2-small" in capsys.readouterr().out
