"""The zoo's Llama layer keeps for backward what a Megatron-grade layer keeps (issue 40 item 2):
grouped-query keys and values at their own heads, SwiGLU saving its two inputs only
([Note: lean SwiGLU] in autoplan/models/ops.py), RMSNorm saving its input and an fp32 rstd a row on
every device ([Note: lean RMSNorm]), checked against Korthikanti et al.'s count as
benchmarks/lean_layer.py adapts it, measured on this machine's CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _scripts import load_benchmark

import autoplan
from autoplan.cost.memory import fused_norm_surplus
from autoplan.models.config import LlamaConfig
from autoplan.models.llama import LlamaLayer, LlamaMLP
from autoplan.models.ops import RMSNorm, rms_norm, swiglu

ROOT = Path(__file__).resolve().parents[1]
# llama3-8b's ratios (f / h = 3.5, 4 query heads per key/value head) at a width a CPU runs at once
SMALL = dict(hidden_size=256, num_heads=8, num_kv_heads=2, ffn_hidden_size=896)
SPEC = "llama3-8b:num_layers=2,hidden_size=256,num_heads=8,num_kv_heads=2,ffn_hidden_size=896,vocab_size=512"
SEQ, BATCH = 64, 2


def _formula():
    return load_benchmark("lean_layer").korthikanti_terms


def _saved(module: torch.nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Every storage `module`'s forward saves for backward, once (parameters and buffers excluded)."""
    state = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in state:
            saved.setdefault(key, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return list(saved.values())


def _layer(dtype: torch.dtype = torch.bfloat16) -> tuple[LlamaConfig, LlamaLayer]:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_layers=2, max_seq_len=SEQ, **SMALL)
    return cfg, LlamaLayer(cfg).to(dtype)


def test_measured_saved_bytes_per_layer_match_korthikanti_within_10_percent():
    cfg, layer = _layer()
    h = cfg.hidden_size
    x = torch.randn(BATCH, SEQ, h, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(layer, x)
    per_sbh = sum(t.untyped_storage().nbytes() for t in saved) / (SEQ * BATCH * h)
    formula = sum(_formula()(h, cfg.ffn_hidden_size, cfg.num_heads, cfg.num_kv_heads).values())
    # Measured on this CPU as it is, no correction: the norms keep what CUDA's fused kernel keeps.
    assert abs(per_sbh / formula - 1) < 0.10, (per_sbh, formula)
    assert per_sbh < 36, per_sbh  # 56 before issue 40: k/v repeated (+3), silu's output (+7), fp32 norms (+12)
    fp32_hidden = [t for t in saved if t.dtype == torch.float32 and t.shape[-1] == h]
    assert not fp32_hidden, [tuple(t.shape) for t in fp32_hidden]  # no fp32 copy of a norm's input


def test_profile_saved_bytes_per_layer_match_korthikanti_within_10_percent():
    prof = autoplan.profile(SPEC, batch_size=BATCH, seq_len=SEQ, dtype="bf16")
    block = next(b for b in prof.blocks if b.kind == "layer")
    h = prof.hidden_size
    assert fused_norm_surplus(block, h) == (0.0, 0.0)  # nothing to take off for a GPU: the same on both
    profiled = block.saved_bytes / (SEQ * BATCH * h)
    formula = sum(_formula()(h, SMALL["ffn_hidden_size"], SMALL["num_heads"], SMALL["num_kv_heads"]).values())
    assert abs(profiled / formula - 1) < 0.10, (profiled, formula)
    cfg, layer = _layer()
    x = torch.randn(BATCH, SEQ, h, dtype=torch.bfloat16, requires_grad=True)
    measured = sum(t.untyped_storage().nbytes() for t in _saved(layer, x))
    assert block.saved_bytes == measured  # the profile (fake tensors) counts what the runtime keeps
    # Attention FLOPs are those of the query heads, as with repeated keys and values: 4 b s^2 h
    assert block.attention_core_fwd_flops == 4 * BATCH * SEQ * SEQ * h


def test_no_key_or_value_repeated_to_the_query_heads_is_saved():
    cfg, layer = _layer()
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    shapes = [tuple(t.shape) for t in _saved(layer, x)]
    d = cfg.head_dim
    assert shapes.count((BATCH, cfg.num_heads, SEQ, d)) == 2, shapes  # q and the attention output, not k or v
    assert shapes.count((BATCH, cfg.num_kv_heads, SEQ, d)) == 2, shapes  # k and v at their own heads


def test_mlp_saves_gate_up_and_product_only():
    cfg, layer = _layer()
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    widths = [t.shape[-1] for t in _saved(layer.mlp, x)]
    assert sorted(widths) == [cfg.hidden_size] + [cfg.ffn_hidden_size] * 3, widths


def test_swiglu_gradient_matches_reference_float64():
    torch.manual_seed(0)
    gate = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate, up))
    mlp = LlamaMLP(LlamaConfig(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=12)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mlp, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_gradients_bitwise_equal_to_composite(dtype):
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(num_layers=1, hidden_size=32, num_heads=2, ffn_hidden_size=48)).to(dtype)
    x = torch.randn(2, 7, 32, dtype=dtype)
    grads = []
    for forward in (mlp, lambda t: mlp.w2(F.silu(mlp.w1(t)) * mlp.w3(t))):
        leaf = x.clone().requires_grad_()
        out = forward(leaf)
        out.backward(torch.ones_like(out))
        grads.append([out.detach(), leaf.grad, *(p.grad.clone() for p in mlp.parameters())])
        mlp.zero_grad(set_to_none=True)
    for ours, reference in zip(*grads, strict=True):
        assert torch.equal(ours, reference)


def test_swiglu_traces_with_fx_export_and_fake_tensors():
    mlp = LlamaMLP(LlamaConfig(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=12))
    x = torch.randn(2, 3, 8)
    graph = torch.fx.symbolic_trace(mlp)
    assert any(n.target is torch.ops.autoplan.swiglu.default or n.target is torch.ops.autoplan.swiglu
               for n in graph.graph.nodes), graph.graph
    assert torch.equal(graph(x), mlp(x))
    exported = torch.export.export(mlp, (x,))
    assert torch.equal(exported.module()(x), mlp(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = mlp(torch.empty(2, 3, 8))
    assert out.shape == (2, 3, 8)


def test_profile_records_swiglu_as_the_kernels_that_run():
    prof = autoplan.profile(SPEC, batch_size=1, seq_len=SEQ, dtype="bf16")
    block = next(b for b in prof.blocks if b.kind == "layer")
    names = {(op.phase, op.name) for op in block.ops}
    assert ("fwd", "silu") in names and ("bwd", "silu_backward") in names, names
    assert not any("swiglu" in name for _, name in names), names


@pytest.mark.extended
def test_suggest_then_run_tp2_small_llama(tmp_path):
    """The user's path: plan a tensor-parallel run of a small Llama and run it on two processes."""
    plan_path = tmp_path / "p.json"
    model = "llama:num_layers=2,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=256,max_seq_len=64"
    suggest = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", model, "--cluster", "1x2xcpu",
                              "--global-batch", "4", "--seq-len", "32", "--tp", "2", "--dtype", "fp32",
                              "--out", str(plan_path)], capture_output=True, text=True, timeout=240)
    assert suggest.returncode == 0, suggest.stderr[-800:]
    assert json.loads(plan_path.read_text())["tp"] == 2
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(plan_path), "--nproc", "2", "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-800:]


def test_swiglu_on_dtensors_keeps_their_placement(tmp_path):
    """Tensor parallelism on an inlined graph computes in DTensor: the operator runs on the shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        gate, up = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
        dgate, dup = (distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (gate, up))
        out = swiglu(dgate, dup)
        out.sum().backward()
        (F.silu(gate) * up).sum().backward()
        assert out.placements == (Shard(1),)
        assert torch.equal(out.full_tensor(), F.silu(gate) * up)
        assert torch.equal(dgate.grad.full_tensor(), gate.grad) and torch.equal(dup.grad.full_tensor(), up.grad)
    finally:
        dist.destroy_process_group()


# -- the zoo's RMSNorm: the fused kernel's saved set on every device ([Note: lean RMSNorm]) --------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_equals_f_rms_norm_and_saves_input_and_rstd_only(dtype, affine):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, dtype=dtype)
    weight = torch.nn.Parameter(torch.randn(64, dtype=dtype)) if affine else None
    results = []
    for norm in (rms_norm, F.rms_norm):
        module = torch.nn.Module()
        module.weight = weight
        module.forward = lambda t, norm=norm, module=module: norm(t, (64,), module.weight, 1e-6)
        leaf = x.clone().requires_grad_()
        saved = _saved(module, leaf)  # the weight is a parameter: not counted
        out = norm(leaf, (64,), weight, 1e-6)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out))
        results.append((out.detach(), leaf.grad, weight.grad.clone() if affine else None, saved))
        if affine:
            weight.grad = None
    (out, gx, gw, saved), (ref, ref_gx, ref_gw, ref_saved) = results
    assert torch.equal(out, ref)  # forward: torch's own composite, the values F.rms_norm gives
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gx, ref_gx, **tol)
    if affine:
        torch.testing.assert_close(gw, ref_gw, **tol)
    # x in its own dtype and one fp32 rstd a row, where the composite keeps fp32 copies of x
    assert sorted(((t.dtype, tuple(t.shape)) for t in saved), key=str) == sorted(
        [(dtype, (2, 16, 64)), (torch.float32, (2, 16, 1))], key=str), [(t.dtype, t.shape) for t in saved]
    kept, composite = (sum(t.untyped_storage().nbytes() for t in ts) for ts in (saved, ref_saved))
    # fp32 without a weight the composite keeps x and rstd too; otherwise it keeps more
    assert kept < composite or (dtype == torch.float32 and not affine and kept == composite), (kept, composite)


def test_rms_norm_gradient_matches_reference_float64():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, (8,), b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda a: rms_norm(a, (8,), None, None), (x,))
    w2 = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)  # normalized over two dims
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, (5, 8), b, 1e-5), (x, w2))


def test_rms_norm_module_is_nn_rmsnorm_and_traces_as_one_module():
    norm = RMSNorm(8, eps=1e-5)
    reference = torch.nn.RMSNorm(8, eps=1e-5)
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(2, 3, 8)
    assert isinstance(norm, torch.nn.RMSNorm) and torch.equal(norm(x), reference(x))
    exported = torch.export.export(norm, (x,))
    assert torch.equal(exported.module()(x), norm(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        assert norm(torch.empty(2, 3, 8)).shape == (2, 3, 8)
    # autoplan's tracer keeps it one module, as nn.RMSNorm: the model's final norm is its own block
    prof = autoplan.profile(SPEC, batch_size=1, seq_len=SEQ, dtype="bf16")
    assert [b.name for b in prof.blocks][-2:] == ["norm", "output"], [b.name for b in prof.blocks]


def test_profile_records_rms_norm_as_one_kernel_each_way():
    prof = autoplan.profile(SPEC, batch_size=1, seq_len=SEQ, dtype="bf16")
    block = next(b for b in prof.blocks if b.kind == "layer")
    norms = [(op.phase, op.name, op.count) for op in block.ops if "norm" in op.name]
    assert sorted(norms) == [("bwd", "rms_norm_backward", 2), ("fwd", "rms_norm", 2)], norms
    assert not any(op.name == "zeros" for op in block.ops)  # no zero gradient made for rstd


def test_rms_norm_on_dtensors_keeps_their_placement(tmp_path):
    """A sequence-parallel norm: x a Shard(1) DTensor, its weight Replicate; the operator runs on the
    local rows and the weight's gradient is a Partial sum, as DTensor's own rms_norm gives it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        x, w = torch.randn(2, 6, 8, requires_grad=True), torch.randn(8, requires_grad=True)
        dx = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
        dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        out = rms_norm(dx, (8,), dw, 1e-6)
        out.sum().backward()
        F.rms_norm(x, (8,), w, 1e-6).sum().backward()
        assert out.placements == (Shard(1),)
        assert torch.equal(out.full_tensor(), F.rms_norm(x, (8,), w, 1e-6))
        torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
        torch.testing.assert_close(dw.grad.full_tensor(), w.grad)
    finally:
        dist.destroy_process_group()
