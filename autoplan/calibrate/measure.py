"""What a rank holds, counted from its tensors: the check of cost/memory.py where no GPU allocator
reports it (CPU, gloo).

- `held_state_bytes(pm, optimizer)`: parameters (fp32 masters and bf16 working copies, FSDP shards),
  gradients and optimizer state as the runtime holds them, each storage once (a view, a tied
  parameter or an FSDP shard's padded buffer counted by its storage).
- `LiveBytes`: a TorchDispatchMode that counts every storage an op allocates while it is alive
  (weak references; a storage FSDP frees by resizing it to 0 counts 0), and the peak of that count.
  On a GPU `torch.cuda.max_memory_allocated` is the measure instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "held_state_bytes", "storage_bytes", "storage_key"]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity: its StorageImpl, which keeps its address when FSDP frees and regrows the
    storage in place (`resize_`), where its data pointer changes (counting by data pointer counts a
    regrown storage once per regrowth)."""
    return storage._cdata


def storage_bytes(tensors: Iterable[Any], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors by their local shard), skipping the
    storages in `seen` (updated)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = _local(t).untyped_storage()
        key = storage_key(storage)
        if storage.data_ptr() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def held_state_bytes(pm, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"weights", "grads", "optimizer"}: bytes this rank holds of each (see the module docstring)."""
    from autoplan.runtime.checkpoint import local_optimizer

    seen: set[int] = set()
    masters = [p for _, p in pm.named_masters()]  # a released ZeRO-1 master keeps its fp32 gradient
    working = [p for stage in pm.stages.values() for p in stage.module.parameters()]
    out = {"weights": storage_bytes([*masters, *working], seen),
           "grads": storage_bytes([p.grad for p in [*masters, *working] if p.grad is not None], seen),
           "optimizer": 0}
    if optimizer is not None:
        state = local_optimizer(optimizer).state
        out["optimizer"] = storage_bytes((v for s in state.values() for k, v in s.items() if k != "step"), seen)
    return out


class LiveBytes(TorchDispatchMode):
    """Bytes of every storage an op allocated that is still alive, and the peak of that count."""

    def __init__(self, ignore: set[int] | None = None) -> None:
        super().__init__()
        self.ignore = set() if ignore is None else ignore
        """`storage_key`s of storages that are not the ops' (parameters, buffers)."""
        self._live: dict[int, weakref.ref] = {}
        self.peak = 0

    @property
    def current(self) -> int:
        return sum(s.nbytes() for ref in self._live.values() if (s := ref()) is not None)

    def _forget(self, key: int) -> None:
        self._live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in tree_flatten(out)[0]:
            # A tensor subclass (a DTensor) has no storage of its own: its local tensor is counted
            # when the op on it runs.
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage_key(storage)
                if storage.data_ptr() and key not in self._live and key not in self.ignore:
                    self._live[key] = weakref.ref(storage)
                    weakref.finalize(storage, self._forget, key)
                    grew = True
        if grew or func is torch.ops.aten.resize_.default:
            self.peak = max(self.peak, self.current)
        return out
