"""Pause Python's cyclic garbage collector around allocation-heavy, cycle-free work.

Why: with torch imported the interpreter tracks about half a million container objects, and every
full (generation 2) collection walks all of them: about 0.1-0.15 s each on a 2-core machine. The
search allocates hundreds of thousands of small tuples, lists and arrays (schedule actions,
simulation timelines, DP tables) that are freed by reference counting, not by the collector, yet
their allocation count triggers several full collections per search (measured: 0.3 s of a 1.1 s
gpt3-175b search; the collections found at most a few hundred objects to free). The same holds
for analytic profiling on fake tensors, which also imports torch._dynamo (a large import that
triggers full collections of its own).

[Note: hand-over to the old generation]
Everything allocated while the collector is off and still alive at the end sits in the youngest
generation, and the first collection after re-enabling walks all of it: after analytic profiling
(torch._dynamo's import: a few hundred thousand objects, nearly all module-level and long-lived)
that one collection took 0.16 s (measured, gpt3-175b cold, 2-core machine). So on leaving the
outermost pause these objects are moved straight into the oldest generation with `gc.freeze()`
followed at once by `gc.unfreeze()` (both splice linked lists: O(1); CPython's gcmodule.c). Nothing
stays frozen: the objects are ordinary old-generation objects afterwards, and any cycle among them
is collected by the next full collection, as it would be once promoted anyway. This is skipped when
the program has frozen objects of its own (`gc.get_freeze_count() > 0`), since `unfreeze` would
release those too.

The collector is switched back on when the work ends (if it was on before); nothing is leaked.
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
            # Outermost pause only (an inner one finds the collector off): see [Note: hand-over to
            # the old generation].
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
