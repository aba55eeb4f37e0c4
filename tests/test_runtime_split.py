"""Stage construction without a process group: crossing values, shapes, materialization, refusals."""

from __future__ import annotations

import pytest
import torch
from _dist import make_plan
from models import SkipModel

from autoplan import models as zoo
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import append_loss, trace_model
from autoplan.runtime.api import PartitionError, check_model
from autoplan.runtime.parallel.split import (
    build_stage_modules,
    materialize_stages,
    plan_stage_specs,
    propagate_values,
    tied_parameter_names,
)
from autoplan.runtime.parallel.tensor_parallel import check_tp_tracing as _check_tp_tracing

GPT = "gpt:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"


def _gpt_specs(boundaries, micro_batch_size=3):
    model = zoo.build_model(GPT, device="meta")
    traced = append_loss(trace_model(model, zoo.example_inputs(GPT, 1, 16)), zoo.lm_loss)
    inputs = {"input_ids": torch.empty(micro_batch_size, 16, dtype=torch.int64, device="meta"),
              "target": torch.empty(micro_batch_size, 16, dtype=torch.int64, device="meta")}
    return model, traced, plan_stage_specs(traced, boundaries, propagate_values(traced, inputs))


def test_gpt_stages_exchange_one_activation_at_micro_batch_shape():
    _, traced, specs = _gpt_specs((0, 3, 5, 7))
    assert [len(s.send) for s in specs] == [1, 1, 0]
    assert specs[0].send[0].shape == (3, 16, 32) and specs[0].send[0].requires_grad
    assert specs[1].recv == specs[0].send
    assert specs[0].data_inputs == ("input_ids",) and specs[2].data_inputs == ("target",)
    assert len(specs[2].outputs) == 1  # the loss


def test_skip_connection_is_forwarded_through_the_middle_stage():
    model = SkipModel()
    ids = torch.randint(0, 64, (2, 8))
    traced = trace_model(model, (ids,))
    values = propagate_values(traced, {"idx": torch.empty(5, 8, dtype=torch.int64)})
    # blocks: embedding, layers.0..3, norm, head; the skip (embedding output) is used after layers.2.
    specs = plan_stage_specs(traced, (0, 2, 3, 7), values)
    assert len(specs[0].send) == 2 and len(specs[1].send) == 2  # x and the skip, both cuts
    assert [c.name for c in specs[0].send] == ["emb", "layers_0"] and [c.name for c in specs[1].send] == ["emb", "layers_1"]
    assert "emb" not in specs[1].inputs  # forwarded, not used
    assert all(c.shape == (5, 8, 32) for c in specs[0].send)


def test_materializing_a_stage_leaves_every_other_parameter_on_meta():
    model, traced, specs = _gpt_specs((0, 3, 7))
    modules = build_stage_modules(traced, specs)
    aliases = tied_parameter_names(model)
    assert aliases == {"output.weight": "tok_embeddings.weight", "tok_embeddings.weight": "tok_embeddings.weight"}
    materialize_stages([modules[1]], torch.device("cpu"), seed=0, aliases=aliases)
    local = dict(modules[1].named_parameters(remove_duplicate=False))
    assert all(p.device.type == "cpu" for p in local.values())
    assert set(local) == {n for n, _ in model.named_parameters(remove_duplicate=False)
                          if n.startswith(("layers.2.", "layers.3.", "norm.", "output."))}
    others = [n for n, p in model.named_parameters(remove_duplicate=False) if n not in local]
    assert others and all(model.get_parameter(n).device.type == "meta" for n in others)
    # Same values as the full model, the tied head included (initialized as tok_embeddings.weight).
    full = zoo.build_model(GPT, device="cpu")
    for name, p in local.items():
        torch.testing.assert_close(p, full.get_parameter(name), rtol=0, atol=0)


def test_stages_on_one_rank_keep_tied_weights_tied():
    model, traced, specs = _gpt_specs((0, 3, 7))
    modules = build_stage_modules(traced, specs)
    materialize_stages(list(modules.values()), torch.device("cpu"), aliases=tied_parameter_names(model))
    assert modules[0].get_parameter("tok_embeddings.weight") is modules[1].get_parameter("output.weight")


def test_partition_refuses_foreign_models_and_tp_plans():
    model = zoo.build_model(GPT, device="meta")
    traced = trace_model(model, zoo.example_inputs(GPT, 1, 16))
    other = zoo.build_model("gpt:num_layers=4,hidden_size=64,num_heads=4,vocab_size=64,max_seq_len=16", device="meta")
    plan = make_plan(GPT, model_fingerprint(model), traced.block_names, pp=2)
    with pytest.raises(PartitionError, match="fingerprint"):
        check_model(other, plan)
    tp_plan = make_plan(GPT, model_fingerprint(model), traced.block_names, pp=2, tp=2)
    assert check_model(model, tp_plan)["layers.0.attention.qkv"] == "colwise"  # zoo models run tp > 1
    skip = SkipModel()
    skip_traced = trace_model(skip, (torch.randint(0, 64, (2, 8)),))
    skip_plan = make_plan("skip", model_fingerprint(skip), skip_traced.block_names, pp=2, tp=2)
    with pytest.raises(PartitionError, match="no tensor-parallel layout: .*fused q/k/v projection"):
        _check_tp_tracing(skip_traced, check_model(skip, skip_plan))
