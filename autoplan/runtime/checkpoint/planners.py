"""DCP planners that also save and load the DTensor shards DCP cannot describe as one chunk
([Note: strided shards in DCP]); save.py and reader.py hand every state dict through them.

Apart because they are the one place autoplan reaches into DCP's planning API
(`DefaultSavePlanner` / `DefaultLoadPlanner`, write and read items).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# [Note: strided shards in DCP]
# DCP describes a rank's piece of a DTensor as one box (offsets, sizes) of the global tensor. A
# fused q/k/v projection sharded by thirds (`_StridedShard(dim, split_factor=3)`, [Note: fused
# q/k/v] in tensor_parallel_graph.py) holds [q_r | k_r | v_r]: three boxes, which `dcp.save` rejects ("overlapping
# chunks"). Such a DTensor goes to DCP as `Pieces`: its local boxes (found without communication
# by sharding an index vector per dimension as the tensor is sharded) as views of the local tensor;
# `_SavePlanner` writes each as a chunk of the global tensor and `_LoadPlanner` reads into each view
# in place. The checkpoint holds the tensor under its own name and shape, as any other. A fused
# projection sharded part by part (`_BlockShard`: grouped-query heads per key/value group, a
# multi-query key and value whole on every rank) goes the same way, its boxes said by the layout
# (`blocked_boxes`); a part whole on every rank is the same box on each, written once (DCP's
# `dedup_save_plans` keeps one write item per index).


@dataclass
class Pieces:
    shape: torch.Size
    tensor: torch.Tensor  # the local tensor
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]  # (global offsets, sizes, local view)
    whole: Any = None
    """The tensor the pieces stand for (`tensor` itself, or the DTensor whose local tensor it is),
    where its owner wants it back after a load; else None."""


def _needs_pieces(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from autoplan.runtime.parallel.tensor_parallel_graph import blocked_boxes

    return isinstance(value, DTensor) and (any(isinstance(p, _StridedShard) for p in value.placements)
                                           or blocked_boxes(value) is not None)


def pieces_of(value) -> Pieces:
    """The local boxes of a DTensor ([Note: strided shards in DCP])."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from autoplan.runtime.parallel.tensor_parallel_graph import blocked_boxes

    # A fused projection sharded part by part (grouped-query or multi-query heads, [Note: fused
    # projections] in tensor_parallel_graph.py): its placement compares equal to Shard(dim), so the
    # index vector below would give the wrong rows; it says its own boxes.
    boxes = blocked_boxes(value)
    if boxes is not None:
        return Pieces(value.shape, value.to_local(), boxes)
    local = value.to_local()
    runs_per_dim = []
    for d in range(value.dim()):
        placements = [p if isinstance(p, Shard | _StridedShard) and p.dim == d else Replicate()
                      for p in value.placements]
        shape = [1] * value.dim()
        shape[d] = value.shape[d]
        index = torch.arange(value.shape[d], device=local.device).view(shape)
        mine = distribute_tensor(index, value.device_mesh, placements, src_data_rank=None).to_local().flatten().tolist()
        runs = []  # (local start, global start, length)
        for j, g in enumerate(mine):
            if runs and g == runs[-1][1] + runs[-1][2] and j == runs[-1][0] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((j, g, 1))
        runs_per_dim.append(runs)
    boxes = []
    for combo in itertools.product(*runs_per_dim):
        view = local
        for d, (start, _, length) in enumerate(combo):
            view = view.narrow(d, start, length)
        boxes.append((tuple(g for _, g, _ in combo), tuple(n for _, _, n in combo), view))
    return Pieces(value.shape, local, boxes)


def with_pieces(tree: Any) -> Any:
    """`tree` with every DTensor DCP cannot describe replaced by its `Pieces`."""
    if isinstance(tree, Mapping):
        return {k: with_pieces(v) for k, v in tree.items()}
    return pieces_of(tree) if _needs_pieces(tree) else tree


class Placeholder(str):
    """Where a `Pieces` was: a value DCP's set-up keeps as it is (it sets what it does not know
    to None) and flattens to the same key."""


def _take_pieces(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, Pieces]:
    """Replace every `Pieces` in `tree` by a `Placeholder`; {its DCP key (the path joined by dots,
    as DCP's `flatten_state_dict` names it): it}."""
    found: dict[str, Pieces] = {}
    for key, value in tree.items():
        if isinstance(value, Pieces):
            found[".".join((*prefix, str(key)))] = value
            tree[key] = Placeholder()
        elif isinstance(value, dict):
            found.update(_take_pieces(value, (*prefix, str(key))))
    return found


def save_planner():
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class SavePlanner(DefaultSavePlanner):
        """DCP's default planner, plus `Pieces` written box by box."""

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.pieces = _take_pieces(state_dict)
            super().set_up_planner(state_dict, storage_meta, is_coordinator)  # their keys stay in the mappings
            self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self.pieces}

        def create_local_plan(self):
            plan = super().create_local_plan()
            items = [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(
                                   chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                                   properties=TensorProperties.create_from_tensor(pieces.tensor),
                                   size=torch.Size(pieces.shape)))
                     for fqn, pieces in self.pieces.items() for offsets, sizes, _ in pieces.boxes]
            self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
            return self.plan

        def resolve_data(self, write_item):
            pieces = self.pieces.get(write_item.index.fqn)
            if pieces is None:
                return super().resolve_data(write_item)
            offsets = tuple(write_item.index.offset)
            view = next(v for o, _, v in pieces.boxes if o == offsets)
            return view.detach().clone()  # a view would save its whole storage

    return SavePlanner()


def load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class LoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, plus `Pieces` read box by box into views of the local tensor."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.pieces = _take_pieces(state_dict)
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self.pieces}

        def create_local_plan(self):
            # DCP's own planner, less its fallback for checkpoints of torch <= 2.3 (it re-flattens the
            # state dict, `Pieces` included, when a key is missing; ours name every key they read).
            plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
            items = []
            for fqn, pieces in self.pieces.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in pieces.boxes]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return dataclasses.replace(plan, items=[*plan.items, *items])

        def resolve_tensor(self, read_item):
            pieces = self.pieces.get(read_item.dest_index.fqn)
            if pieces is None:
                return super().resolve_tensor(read_item)
            view = pieces.boxes[read_item.dest_index.index][2]
            for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(d, start, length)
            return view

    return LoadPlanner()
