"""One `Layout` (issue 42): every layout field reaches the run fingerprint, the pins, `describe` and
every memo key of the search, unless a site leaves it out by name; and a field added to `Layout`
(the toy dimension of docs/architecture.md, "Adding a parallel dimension") reaches them by itself."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from autoplan import layout as layout_module
from autoplan.cost.config import DESCRIBE_LEAVES_OUT, ParallelConfig
from autoplan.layout import FIRST_RECORDED, LAYOUT_FIELDS, Layout
from autoplan.plan import Plan
from autoplan.search import configs, context, space
from autoplan.search.context import MEMO_KEY_INSTEAD, MEMO_LEAVES_OUT
from tests._cli import run_main

TINY = "gpt:num_layers=4,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=64"


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    """A plan as a user makes it (`suggest --out`), pp 2 and dp 2 so that every degree is in play."""
    path = tmp_path_factory.mktemp("layout") / "plan.json"
    result = run_main("suggest", "--model", TINY, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "16",
                      "--pp", "2", "--dp", "2", "--dtype", "fp32", "--out", str(path))
    assert result.returncode == 0, result.stderr
    return Plan.load(path)


def _other(name: str, value):
    """Another value of a layout field (only that it differs matters: nothing here is validated)."""
    return "tp-pp-dp" if value == "tp-dp-pp" else "tp-dp-pp" if isinstance(value, str) else value + 1


def _keys(cfg: ParallelConfig) -> dict[str, tuple]:
    """Each memo's layout key, as search/context.py and search/space.py build it."""
    keys = {name: memo_key(cfg) for name, memo_key in context._KEY.items()}  # the getters the memos call
    keys["config"] = space._config_key(cfg)
    return keys


def test_plan_and_parallel_config_carry_every_layout_field_with_its_default():
    for cls in (Plan, ParallelConfig):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(LAYOUT_FIELDS) <= set(fields), (cls.__name__, set(LAYOUT_FIELDS) - set(fields))
        for f in dataclasses.fields(Layout):
            if fields[f.name].default is not dataclasses.MISSING:  # tp, pp, dp, ... have none in a plan
                assert fields[f.name].default == f.default, (cls.__name__, f.name)
    assert set(LAYOUT_FIELDS) >= FIRST_RECORDED


def test_the_counts_are_the_layouts(plan):
    cfg = ParallelConfig.of_plan(plan)
    assert plan.layout == cfg.layout == Layout.of(plan) == Layout.of(plan.to_dict())
    for name in ("num_gpus", "num_stages", "replicas", "dp_shard", "expert_token_split", "holds_expert_slices"):
        assert getattr(plan, name) == getattr(cfg, name) == getattr(plan.layout, name), name
    assert plan.num_gpus == 4 and plan.num_stages == 2
    assert [plan.coords(r) for r in range(plan.num_gpus)] == [plan.layout.coords(r) for r in range(4)]
    assert all(plan.rank(*plan.coords(r)) == r for r in range(plan.num_gpus))


@pytest.mark.parametrize("name", LAYOUT_FIELDS)
def test_each_layout_field_reaches_the_fingerprint_pins_describe_and_every_key(plan, name):
    """Fails for a field that some site forgets (or leaves out without naming it)."""
    cfg = ParallelConfig.of_plan(plan)
    value = getattr(cfg, name)
    other_cfg = dataclasses.replace(cfg, **{name: _other(name, value)})
    other_plan = dataclasses.replace(plan, **{name: _other(name, value)})
    assert other_plan.run_fingerprint != plan.run_fingerprint
    assert name in configs.PINS
    if name != "rank_order":  # the pins are "every dimension but the rank layout" (config_pins)
        assert configs.config_pins(other_cfg) != configs.config_pins(cfg)
    if name not in DESCRIBE_LEAVES_OUT:
        assert other_cfg.describe() != cfg.describe()
    keys, other_keys = _keys(cfg), _keys(other_cfg)
    for memo, left_out in {**MEMO_LEAVES_OUT, "config": space.CONFIG_KEY_LEAVES_OUT}.items():
        assert set(left_out) <= set(LAYOUT_FIELDS), (memo, set(left_out) - set(LAYOUT_FIELDS))
        if name in MEMO_KEY_INSTEAD.get(memo, ()):
            continue  # the memo appends a value made from it (`MEMO_KEY_INSTEAD`)
        if name not in left_out:
            assert other_keys[memo] != keys[memo], memo
        else:
            assert other_keys[memo] == keys[memo], memo


@pytest.mark.parametrize("name", [n for n in LAYOUT_FIELDS if n != "rank_order"])
def test_validate_checks_each_degrees_type(plan, name):
    from autoplan.plan import validate

    problems = validate(dataclasses.replace(plan, **{name: "2"}))
    assert any(p.startswith(f"{name} = '2' must be a positive integer") for p in problems), problems


def test_the_cli_pins_every_layout_field_it_has_an_option_for():
    args = argparse.Namespace(**{name: None for name in configs.PINS})
    for name in LAYOUT_FIELDS:
        setattr(args, name, 2 if name != "rank_order" else "tp-pp-dp")
    from autoplan.cli import _pins

    assert set(_pins(args)) == set(LAYOUT_FIELDS)


def test_the_fingerprint_of_a_plan_written_before_the_layout_is_unchanged(plan):
    """The fingerprint as plan.py wrote it before `Layout` (traces and checkpoints recorded then still
    match their plan)."""
    import hashlib

    identity = {
        "model": [plan.model, plan.model_fingerprint, plan.model_digest], "cluster": plan.cluster,
        "job": [plan.job.global_batch, plan.job.seq_len, plan.job.dtype],
        "layout": [plan.tp, plan.pp, plan.dp, plan.cp, plan.ep, plan.zero, plan.dp_replicate, plan.rank_order,
                   plan.sequence_parallel, plan.recompute],
        "schedule": [plan.schedule, plan.virtual_stages, plan.micro_batch_size, plan.num_microbatches],
        "cuts": list(plan.boundaries),
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    assert plan.run_fingerprint == hashlib.sha256(text.encode()).hexdigest()[:16]
    etp = dataclasses.replace(plan, expert_tp=2)
    identity["layout"].append("expert_tp=2")
    text = json.dumps(identity, sort_keys=True, default=str)
    assert etp.run_fingerprint == hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- a toy dimension (docs/architecture.md, "Adding a parallel dimension") ---------------------------------


@pytest.fixture
def toy(monkeypatch, plan):
    """A layout with one more field, `toy` (default 1), as a new dimension adds it: the field on
    `Layout`, `Plan` and `ParallelConfig`, and nothing else. Also what `plan` reads as before."""
    before = {"fingerprint": plan.run_fingerprint, "describe": ParallelConfig.of_plan(plan).describe()}
    toy_field = [("toy", int, dataclasses.field(default=1))]
    toy_layout = dataclasses.make_dataclass("Layout", toy_field, bases=(Layout,), frozen=True, slots=True,
                                            kw_only=True)
    toy_plan = dataclasses.make_dataclass("Plan", toy_field, bases=(Plan,), frozen=True, kw_only=True)
    toy_config = dataclasses.make_dataclass("ParallelConfig", toy_field, bases=(ParallelConfig,), frozen=True,
                                            slots=True, kw_only=True)
    fields = tuple(f.name for f in dataclasses.fields(toy_layout))
    monkeypatch.setattr(layout_module, "Layout", toy_layout)
    monkeypatch.setattr(layout_module, "LAYOUT_FIELDS", fields)
    monkeypatch.setattr(layout_module, "_DEFAULTS", {f.name: f.default for f in dataclasses.fields(toy_layout)})
    return toy_plan, toy_config, before


def test_a_new_layout_field_reaches_the_fingerprint_pins_describe_and_keys_by_itself(toy, plan):
    toy_plan, toy_config, before = toy
    base = toy_plan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)})
    assert base.run_fingerprint == before["fingerprint"]  # at its default: plans written before keep theirs
    assert dataclasses.replace(base, toy=2).run_fingerprint != base.run_fingerprint
    cfg = toy_config.of_plan(base)
    other = toy_config.of_plan(dataclasses.replace(base, toy=2))  # the plan's layout carries it to the search's
    assert cfg.describe() == before["describe"] and other.describe() == before["describe"] + " toy=2"
    assert configs.config_pins(other) == {**configs.config_pins(cfg), "toy": 2}
    assert other.layout.toy == 2 and base.layout == layout_module.Layout.of(base)
    keys, other_keys = _keys(cfg), _keys(other)
    assert all(keys[memo] != other_keys[memo] for memo in keys), "a memo that does not name it keys on it"
    from autoplan.cli import _pins

    args = argparse.Namespace(**{name: None for name in configs.PINS}, toy=3)
    assert _pins(args) == {"toy": 3}


# ---- breakdown terms (issue 42: one set shared by the cost model, the search and the pictures) -----------


def test_a_plans_breakdown_is_keyed_by_the_terms_in_their_order(plan):
    from autoplan.plan import BREAKDOWN_TERMS, BreakdownTerm

    assert set(BREAKDOWN_TERMS) == {v for k, v in vars(BreakdownTerm).items() if k.isupper()}
    keys = list(plan.predicted.breakdown)
    assert keys and set(keys) <= set(BREAKDOWN_TERMS)
    assert keys == [term for term in BREAKDOWN_TERMS if term in keys]
    assert all(type(key) is str for key in keys)  # the plan file's keys, as before

