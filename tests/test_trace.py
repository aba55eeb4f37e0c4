"""Tracing: blocks, cuts, tracer fallbacks, and sub-graphs that recompose to the model."""

from __future__ import annotations

import pytest
import torch

from autoplan.graph import zoo
from autoplan.graph.profile import profile_model
from autoplan.graph.trace import TraceError, extract_submodule, find_layer_container, trace_model
from tests.models import IntCrossingModel, ShapeBranchModel, SkipModel, Untraceable, ValueCheckModel


def _ids(shape=(2, 16), vocab=64, device="cpu"):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0)).to(device)


def test_blocks_are_embedding_layers_norm_head():
    traced = trace_model(SkipModel(), (_ids(),))
    assert traced.tracer == "fx"
    assert traced.block_names == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    assert traced.layer_container == "layers"


def test_zoo_layer_container_is_found():
    assert find_layer_container(zoo.build_model("llama3-8b:num_layers=3")) == "layers"


def test_skip_connection_over_two_blocks_is_on_every_cut_it_crosses():
    with torch.device("meta"):
        model = SkipModel()
    profile, _ = profile_model(model, (_ids(device="meta"),), dtype=torch.float32)
    crossing = {c.index: sorted(t.name for t in c.tensors) for c in profile.cuts}
    # The embedding output `emb` is produced in block 0 and used after layer 2 (block 3).
    assert crossing[0] == ["emb"]
    assert crossing[1] == ["emb", "layers_0"]
    assert crossing[2] == ["emb", "layers_1"]
    assert crossing[3] == ["add"]
    hidden_bytes = 2 * 16 * 32 * 4
    assert profile.cuts[1].num_bytes == 2 * hidden_bytes
    assert profile.blocks[1].output_bytes == 2 * hidden_bytes


def test_non_tensor_crossing_makes_cut_illegal():
    model = IntCrossingModel()
    profile, _ = profile_model(model, (torch.randn(2, 5, 16),), dtype=torch.float32)
    assert not any(c.legal for c in profile.cuts[1:])
    assert "not a tensor" in profile.cuts[1].reason
    assert profile.legal_cuts() == [c.index for c in profile.cuts if c.legal]


def test_fx_failure_falls_back_to_export():
    traced = trace_model(ShapeBranchModel(), (_ids(),))
    assert traced.tracer == "export"
    assert "fx failed" in traced.note
    assert traced.block_names[1:5] == ["layers.0", "layers.1", "layers.2", "layers.3"]


def test_export_failure_falls_back_to_module_boundaries():
    traced = trace_model(ValueCheckModel(), (_ids(),))
    assert traced.tracer == "modules"
    assert "fx failed" in traced.note and "export failed" in traced.note
    assert "registration order" in traced.note
    assert traced.block_names == ["embedding", "layers.0", "layers.1", "layers.2", "head"]


def test_untraceable_model_says_what_to_do():
    with pytest.raises(TraceError, match="leaf modules") as info:
        trace_model(Untraceable(), (torch.randn(2, 8),))
    assert "\n" not in str(info.value)


def test_user_leaf_modules_become_blocks():
    model = zoo.build_model("gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16")
    traced = trace_model(model, (_ids(),), leaf_modules=["layers.*.attention", "layers.*.mlp"])
    assert traced.block_names[1:5] == ["layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp"]


def test_unknown_leaf_module_is_an_error():
    with pytest.raises(TraceError, match="matches no module"):
        trace_model(SkipModel(), (_ids(),), leaf_modules=["layers.*.nope"])


@pytest.mark.parametrize("model_factory", [SkipModel, ShapeBranchModel, ValueCheckModel])
def test_block_submodules_recompose_to_the_model(model_factory):
    """Running the blocks one after another, passing crossing tensors, equals the model."""
    torch.manual_seed(0)
    model = model_factory()
    x = _ids()
    traced = trace_model(model, (x,))
    env = dict(zip(traced.input_names, (x,), strict=True))
    for i in range(traced.num_blocks):
        sub, inputs, outputs = extract_submodule(traced, i, i)
        results = sub(*[env[n] for n in inputs])
        env.update(zip(outputs, results, strict=True))
        # Parameter names are the model's own.
        names = {n for n, _ in sub.named_parameters()}
        assert names <= {n for n, _ in model.named_parameters()}
    torch.testing.assert_close(env[outputs[-1]], model(x))


def test_block_parameters_partition_the_model():
    model = SkipModel()
    traced = trace_model(model, (_ids(),))
    seen: list[str] = []
    for i in range(traced.num_blocks):
        sub, _, _ = extract_submodule(traced, i, i)
        seen += [n for n, _ in sub.named_parameters()]
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())
