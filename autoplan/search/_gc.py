"""Pause Python's cyclic garbage collector around allocation-heavy, cycle-free work.

Why: with torch imported the interpreter tracks about half a million container objects, and every
full (generation 2) collection walks all of them: about 0.1-0.15 s each on a 2-core machine. The
search allocates hundreds of thousands of small tuples, lists and arrays (schedule actions,
simulation timelines, DP tables) that are freed by reference counting, not by the collector, yet
their allocation count triggers several full collections per search (measured: 0.3 s of a 1.1 s
gpt3-175b search; the collections found at most a few hundred objects to free). The same holds
for analytic profiling on fake tensors, which also imports torch._dynamo (a large import that
triggers full collections of its own).

The collector is switched back on when the work ends (if it was on before), so cycles created
meanwhile are collected by the next automatic collection; nothing is frozen or leaked.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; restore its previous state after (nests)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
