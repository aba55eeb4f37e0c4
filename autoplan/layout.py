"""`Layout`: how a plan lays its ranks out, the parallel degrees and the rank order, declared once.

`Plan` (plan.py) and `ParallelConfig` (cost/config.py) both carry these fields and both derive
their counts (GPUs, stages, replicas, FSDP shard width, a rank's coordinates) from them through
`LayoutCounts`, written here once; a field they do not declare themselves they take from `Layout`,
with its default (`carries_layout`), so a new degree is one field here. Everything that must see every degree (the run fingerprint, the
pins `suggest` takes, `describe`, the search's memo keys) walks `LAYOUT_FIELDS` instead of naming
the degrees, so a field added to `Layout` reaches all of them unless a site leaves it out by name
(tests/test_layout.py enumerates the fields and checks each one).

[Note: rank layout] in plan.py says how ranks are numbered.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FIRST_RECORDED", "LAYOUT_FIELDS", "RANK_ORDERS", "Layout", "LayoutCounts", "carries_layout", "layout_key_getter", "layout_rank"]

RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp")


def layout_rank(rank_order: str, tp: int, pp: int, dp: int, pp_index: int, dp_index: int, tp_index: int) -> int:
    """Global rank of a (pp, dp, tp) coordinate under `rank_order`; see plan.py [Note: rank layout]."""
    if rank_order == "tp-dp-pp":
        return tp_index + tp * (dp_index + dp * pp_index)
    return tp_index + tp * (pp_index + pp * dp_index)


class LayoutCounts:
    """The counts derived from a layout's fields, for any class that carries them (`Layout`, `Plan`,
    `ParallelConfig`): written once here."""

    __slots__ = ()

    @property
    def layout(self) -> Layout:
        """The degrees and rank order alone."""
        return Layout(**self.layout_values())

    def layout_values(self) -> dict[str, Any]:
        """{field: value} for every layout field (keyword arguments for `Plan`, `ParallelConfig`)."""
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def replicas(self) -> int:
        """Data-parallel ranks that take distinct batches: dp / cp."""
        return self.dp // self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks one FSDP shard group spans (zero >= 2); dp for zero 0 / 1 (they shard nothing or
        only the optimizer state, over all of dp)."""
        return self.dp // self.dp_replicate

    @property
    def expert_token_split(self) -> int:
        """Ways a replica's tp ranks split the tokens that reach its experts: tp / expert tp with
        ep > 1 (tp under expert tp 1, 1 under expert tp tp), as the runtime does (runtime/parallel/experts.py),
        else 1: without ep every tp rank computes its experts on every token. Its tp ranks then take
        part in the expert layout as ranks of their own, the ep groups folded over tp x dp (plan.py
        [Note: expert layout]; [Note: experts on a GPU] in cost/experts.py)."""
        return self.tp // self.expert_tp if self.ep > 1 else 1

    @property
    def holds_expert_slices(self) -> bool:
        """Whether a rank holds a slice of each layer's experts (ep > 1 or expert tp > 1)."""
        return self.ep * self.expert_tp > 1

    def rank(self, pp_index: int, dp_index: int, tp_index: int = 0) -> int:
        """Global rank of a (pp, dp, tp) coordinate; see plan.py [Note: rank layout]."""
        return layout_rank(self.rank_order, self.tp, self.pp, self.dp, pp_index, dp_index, tp_index)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_index, dp_index, tp_index) of a global rank."""
        tp_index, rest = rank % self.tp, rank // self.tp
        if self.rank_order == "tp-dp-pp":
            return rest // self.dp, rest % self.dp, tp_index
        return rest % self.pp, rest // self.pp, tp_index

    def layout_key(self, without: tuple[str, ...] = (), **instead: Any) -> tuple:
        """The layout fields' values for a memo key, in `LAYOUT_FIELDS` order: all but those in `without`
        (what the memoized value provably does not depend on) and those given `instead` (a field it
        depends on only in part, `pp=cfg.pp == 1`), whose values follow. A field added to `Layout`
        enters every key. On the search's hot path: the getter is made once per call site."""
        return _key_getter(LAYOUT_FIELDS, without, tuple(instead))(self) + tuple(instead.values())

    def later_fields(self) -> dict[str, Any]:
        """The layout fields added after the first plans were written (not in `FIRST_RECORDED`) that
        are away from their default: what enters a fingerprint or the pins as `name=value`, so that
        plans recorded before a field existed keep their fingerprints."""
        return {name: getattr(self, name) for name in LAYOUT_FIELDS
                if name not in FIRST_RECORDED and getattr(self, name) != _DEFAULTS[name]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout(LayoutCounts):
    """The parallel degrees of a plan and the order its ranks are numbered in. A field added here
    reaches the fingerprint, the pins, `describe` and every memo key (tests/test_layout.py); the
    plan file keeps its flat fields (`Plan.tp`, ...), so plans written before read the same."""

    tp: int = 1
    """Tensor-parallel degree (Megatron column/row sharding inside a node)."""
    pp: int = 1
    """Pipeline ranks."""
    dp: int = 1
    """Data-parallel ranks, the cp ranks of each replica counted (dp / cp replicas)."""
    cp: int = 1
    """Context-parallel degree: groups of cp consecutive dp ranks split every sequence."""
    ep: int = 1
    """Expert-parallel degree (plan.py [Note: expert layout])."""
    expert_tp: int = 1
    """Expert tensor-parallel degree, 1 or tp (plan.py [Note: expert layout])."""
    dp_replicate: int = 1
    """HSDP: the dp ranks form dp_replicate groups of dp / dp_replicate that FSDP shards over."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (looped schedules)."""
    rank_order: str = "tp-dp-pp"
    """Which of dp and pp is numbered next after tp (plan.py [Note: rank layout])."""

    @classmethod
    def of(cls, obj: Any) -> Layout:
        """The layout of anything that carries the fields (a `Plan`, a `ParallelConfig`), or of a
        mapping of them (absent fields take their defaults: pins are a partial layout)."""
        if isinstance(obj, Mapping):
            return cls(**{name: obj[name] for name in LAYOUT_FIELDS if obj.get(name) is not None})
        return cls(**LayoutCounts.layout_values(obj))


LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))
"""Every layout field, in declaration order."""
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Layout)}
FIRST_RECORDED = frozenset({"tp", "pp", "dp", "cp", "ep", "dp_replicate", "virtual_stages", "rank_order"})
"""Layout fields the first plans' fingerprints and pins named in fixed places (`Plan.run_fingerprint`,
search/configs.py `config_pins`); every later one enters them by `LayoutCounts.later_fields`."""


def carries_layout(cls: type) -> type:
    """Class decorator, applied under `@dataclass`: every `Layout` field that `cls` (or a base) does
    not declare is added to it with the `Layout` default, after its own fields (all of which a later
    field follows with a default, so the order of `Plan`'s positional fields is kept). `Plan` and
    `ParallelConfig` declare the fields written before this existed, with their own docstrings; a
    degree added to `Layout` reaches both by itself (docs/architecture.md, "Adding a parallel
    dimension")."""
    declared = {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}
    annotations = dict(vars(cls).get("__annotations__", {}))
    for f in dataclasses.fields(Layout):
        if f.name not in declared:
            annotations[f.name] = f.type
            setattr(cls, f.name, f.default)
    cls.__annotations__ = annotations
    return cls


def layout_key_getter(without: tuple[str, ...] = (), instead: tuple[str, ...] = ()) -> Callable[[Any], tuple]:
    """`LayoutCounts.layout_key`'s getter, made once by a call site on the search's hot path: it
    returns the fields but `without` and `instead`, and the caller appends the values it gives
    `instead` (keyword arguments and the getter's lookup cost more than the key itself there). It
    reads `LAYOUT_FIELDS` again whenever that changes, as `layout_key` does (tests/test_layout.py adds
    a field after import)."""
    without, instead = tuple(without), tuple(instead)
    made: list = [None, None]  # the fields the getter was made for, and the getter

    def key(obj: Any) -> tuple:
        if made[0] is not LAYOUT_FIELDS:
            made[0], made[1] = LAYOUT_FIELDS, _key_getter(LAYOUT_FIELDS, without, instead)
        return made[1](obj)

    return key


@functools.cache
def _key_getter(fields: tuple[str, ...], without: tuple[str, ...], instead: tuple[str, ...]):
    """The getter of `fields` but `without` and `instead`, as a tuple (`LayoutCounts.layout_key`)."""
    unknown = (set(without) | set(instead)) - set(fields)
    assert not unknown, f"not layout fields: {sorted(unknown)}"
    kept = [name for name in fields if name not in without and name not in instead]
    if len(kept) == 1:  # attrgetter of one name returns the value, not a tuple
        return lambda obj: (getattr(obj, kept[0]),)
    return operator.attrgetter(*kept)
