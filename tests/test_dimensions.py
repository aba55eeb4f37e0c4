"""A dimension is one module (issue 42 item 2): the runtime's dimensions are listed once, in order, in
runtime/execution/dimensions/registry.py, every layout field is run by one of them, and `partition` and
`PartitionedModel.step` call their hooks instead of naming each one. The toy dimension of
docs/architecture.md, "Adding a parallel dimension", is built here from a fixture as a new dimension
is written (a `Layout` field, a `Dimension`, one registry line) and reaches the fingerprint, the pins,
the memo keys, the refusals before a process group and every per-step hook of a one-process run."""

from __future__ import annotations

import argparse
import dataclasses
from contextlib import contextmanager
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

import autoplan
from autoplan import layout as layout_module
from autoplan.cost.config import ParallelConfig
from autoplan.layout import LAYOUT_FIELDS, Layout, carries_layout
from autoplan.plan import Plan
from autoplan.runtime.execution.dimensions import Checked, Dimension, registry
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.search import configs

SPEC = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"
GLOBAL_BATCH, SEQ = 4, 16


def test_every_layout_field_is_run_by_one_dimension_and_each_is_registered_once():
    names = [d.name for d in registry.DIMENSIONS]
    assert len(set(names)) == len(names), names
    for name in LAYOUT_FIELDS:
        owners = [d.name for d in registry.DIMENSIONS if name in d.fields]
        assert len(owners) == 1, (name, owners)
    assert {f for d in registry.DIMENSIONS for f in d.fields} == set(LAYOUT_FIELDS)


def test_the_registry_is_the_order_of_partitions_steps():
    """api.py [Note: the order of partition's steps]: tp before materialization and cp, ep on initialized
    weights, precision after every step that replaces parameters, recompute after it, FSDP last."""
    assert [d.name for d in registry.DIMENSIONS] == ["pp", "tp", "cp", "ep", "precision", "recompute", "dp"]
    assert [d.name for d in registry.DIMENSIONS if d.on_meta_first] == ["tp"]
    assert registry.dimension_of_field("expert_tp").name == "ep"


# ---- the toy dimension (docs/architecture.md, "Adding a parallel dimension") ----------------------------


class Toy(Dimension):
    """What a new dimension's module holds: its name, its layout field, its refusal and its hooks
    (here recording their calls)."""

    name: ClassVar[str] = "toy"
    fields: ClassVar[tuple[str, ...]] = ("toy",)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def refuse(self, checked: Checked) -> None:
        self.calls.append("refuse")
        if checked.plan.toy > 1:
            raise PartitionError(f"the plan has toy {checked.plan.toy} but the toy runs at 1 only; re-plan it")

    def apply(self, build, plan, layout) -> None:
        self.calls.append("apply")

    def wrap(self, build, plan, layout) -> None:
        self.calls.append("wrap")

    def before_step(self, pm) -> None:
        self.calls.append("before_step")

    def split_input(self, pm, value):
        self.calls.append("split_input")
        return value

    def before_run(self, pm) -> None:
        self.calls.append("before_run")

    @contextmanager
    def _around(self):
        self.calls.append("enter")
        yield
        self.calls.append("exit")

    def run_context(self, pm):
        return self._around()

    def after_backward(self, pm) -> None:
        self.calls.append("after_backward")

    def reduce_grads(self, pm) -> None:
        self.calls.append("reduce_grads")

    def after_reduce(self, pm) -> None:
        self.calls.append("after_reduce")

    def after_evaluate(self, pm) -> None:
        self.calls.append("after_evaluate")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return autoplan.suggest(SPEC, "1x1xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32", top=1)[0]


@pytest.fixture
def toy(monkeypatch, plan):
    """The toy dimension as a new one is written: a `toy` field on `Layout` (default 1), which `Plan` and
    `ParallelConfig` take by `carries_layout` as they would at import, and a `Toy` registered by one line
    (before dp, FSDP's wrap staying last). Also the plan's fingerprint before, and the registry without it."""
    before = plan.run_fingerprint
    without = registry.DIMENSIONS
    toy_layout = dataclasses.make_dataclass("Layout", [("toy", int, dataclasses.field(default=1))], bases=(Layout,),
                                            frozen=True, slots=True, kw_only=True)
    monkeypatch.setattr(layout_module, "Layout", toy_layout)
    monkeypatch.setattr(layout_module, "LAYOUT_FIELDS", tuple(f.name for f in dataclasses.fields(toy_layout)))
    monkeypatch.setattr(layout_module, "_DEFAULTS", {f.name: f.default for f in dataclasses.fields(toy_layout)})
    toy_plan = dataclasses.dataclass(frozen=True, kw_only=True)(
        carries_layout(type("Plan", (Plan,), {"__module__": Plan.__module__})))
    toy_config = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(
        carries_layout(type("ParallelConfig", (ParallelConfig,), {"__module__": ParallelConfig.__module__})))
    dimension = Toy()
    monkeypatch.setattr(registry, "DIMENSIONS", (*registry.DIMENSIONS[:-1], dimension, registry.DIMENSIONS[-1]))
    return toy_plan, toy_config, dimension, before, without


def _as(cls, obj, **change):
    """`obj`'s fields (a plan's) as a `cls` (the toy Plan or ParallelConfig), `change`d."""
    return cls(**{**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if hasattr(obj, f.name)}, **change})


def test_the_toy_field_reaches_the_fingerprint_pins_and_keys(toy, plan):
    toy_plan, toy_config, dimension, before, _ = toy
    assert "toy" in {f.name for f in dataclasses.fields(toy_plan)} & {f.name for f in dataclasses.fields(toy_config)}
    one, two = _as(toy_plan, plan), _as(toy_plan, plan, toy=2)
    assert one.toy == 1 and one.run_fingerprint == before  # at its default: plans written before keep theirs
    assert two.run_fingerprint != one.run_fingerprint
    assert layout_module.Layout.of(two).toy == 2 and layout_module.Layout.of(one.to_dict()).toy == 1
    cfg_one = _as(toy_config, one)
    cfg_two = dataclasses.replace(cfg_one, toy=2)
    assert "toy" not in configs.config_pins(cfg_one)
    assert configs.config_pins(cfg_two) == {**configs.config_pins(cfg_one), "toy": 2}
    assert cfg_two.layout_key() != cfg_one.layout_key() and cfg_two.describe().endswith(" toy=2")
    from autoplan.cli import _pins

    assert _pins(argparse.Namespace(toy=2))["toy"] == 2
    assert registry.dimension_of_field("toy") is dimension


def test_the_toy_dimensions_refusal_comes_before_any_process_group(toy, plan):
    toy_plan, _, dimension, _, _ = toy
    with pytest.raises(PartitionError, match=r"^the plan has toy 2 but the toy runs at 1 only; re-plan it$"):
        autoplan.partition(SPEC, _as(toy_plan, plan, toy=2), device="cpu")
    assert dimension.calls == ["refuse"] and not dist.is_initialized()


def test_partition_and_step_call_the_toy_dimensions_hooks_in_their_places(toy, plan):
    """One process: `partition` refuses, applies and wraps through the registry, `step` and `evaluate`
    call every per-step hook once, in the order of [Note: a dimension's hooks]; the toy changes no number."""
    toy_plan, _, dimension, _, without = toy
    with pytest.MonkeyPatch.context() as patch:  # the same plan without the toy
        patch.setattr(registry, "DIMENSIONS", without)
        reference = autoplan.partition(SPEC, plan, device="cpu")
    template = reference.output_template
    (ids, *_), target = reference.source.batch(0, 0, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
    expected = float(reference.step(ids, target=target))
    dist.destroy_process_group()
    dimension.calls.clear()
    pm = autoplan.partition(SPEC, _as(toy_plan, plan), device="cpu")
    assert dimension in pm.dimensions
    assert dimension.calls == ["refuse", "apply", "wrap"]
    dimension.calls.clear()
    loss = pm.step(ids, target=target)
    assert dimension.calls == ["before_step", "split_input", "split_input", "before_run", "enter", "exit",
                               "after_backward", "reduce_grads", "after_reduce"]  # split: the ids and the target
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pm.parameters())
    dimension.calls.clear()
    pm.evaluate(ids, target=target)
    assert dimension.calls == ["before_step", "split_input", "split_input", "enter", "exit", "after_evaluate"]
