"""How many micro-batches each pipeline stage holds at its peak, from a schedule's structure alone.

Apart from the scoring because it needs no times: the order in which a schedule runs its forwards and
backwards fixes what each stage holds (closed forms for GPipe, 1F1B and ZB-H1, a prefix scan of each
rank's action order for interleaved 1F1B). The cutting DP sizes stages with it
(search/evaluate.py) and the plan's memory is counted with it (search/assemble.py `rank_memories`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from autoplan.schedule import ActionKind, make_schedule, schedule_spec, simulate

__all__ = ["RankMoments", "interleaved_at_peak", "interleaved_held", "interleaved_moments", "rank_moments",
           "schedule_inflight"]


@functools.lru_cache(maxsize=4096)
def schedule_inflight(name: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[int, ...]:
    """Peak micro-batches in flight per virtual stage, from the schedule's structure (unit times).

    GPipe holds all m (Huang et al. 2019); 1F1B holds p - s on stage s (Narayanan et al. 2021, Sec.
    2.2.1); ZB-H1 holds p on every stage until its W (Qi et al. 2024, Sec. 3.1); all capped at m.
    tests/test_search.py checks these closed forms against the simulator. Interleaving is simulated.
    """
    m = num_microbatches
    held = schedule_spec(name).held
    if held == "all":
        return (m,) * pp
    if held == "depth":
        return tuple(min(pp - s, m) for s in range(pp))
    if held == "pipeline":
        return (min(pp, m),) * pp
    if held == "interleaved":
        return _interleaved_inflight(pp, m, virtual_stages)
    schedule = make_schedule(name, pp, num_microbatches, virtual_stages)
    return simulate(schedule, lambda a: 1.0).peak_inflight


@functools.lru_cache(maxsize=64)
def interleaved_held(pp: int, m: int, v: int) -> tuple[np.ndarray, ...]:
    """Per pipeline rank of interleaved 1F1B: the micro-batches each of its v chunks holds right
    after each of its forwards (the moments its activations grow), one row per distinct moment,
    columns chunk 0 .. v - 1; from the rank's action order as `_interleaved_inflight` scans it.
    A rank's activations peak at the largest weighted row sum, which is less than the sum of its
    chunks' own peaks: they do not peak together (chunk 0 peaks at the end of the warm-up, the last
    chunk later). At the end of rank r's warm-up it holds (p - r - 1) * 2 + (v - 1) * p + 1
    chunk-micro-batches, Megatron-LM's count (Narayanan et al. 2021, Sec. 2.2.2: the first stage
    holds p (1 + (p - 1) / (p v)) micro-batches' worth of its layers)."""
    total = m * v
    k = np.arange(total)
    fwd_chunk = (k % (pp * v)) // pp
    fwd_count = np.zeros((v, total + 1), dtype=np.int64)
    bwd_count = np.zeros((v, total + 1), dtype=np.int64)
    np.cumsum(fwd_chunk[None, :] == np.arange(v)[:, None], axis=1, out=fwd_count[:, 1:])
    np.cumsum((v - 1 - fwd_chunk)[None, :] == np.arange(v)[:, None], axis=1, out=bwd_count[:, 1:])
    out = []
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        held = fwd_count[:, k + 1] - bwd_count[:, np.maximum(k - warmup, 0)]  # (v, moments)
        out.append(np.unique(held.T, axis=0))
    return tuple(out)


class RankMoments(NamedTuple):
    """One pipeline rank's distinct moments (rows) over its chunks (columns, chunk 0 .. v - 1); see
    `interleaved_moments`."""

    held: np.ndarray
    """Micro-batches whose activations the chunk keeps."""
    gathered: np.ndarray
    """1 from the chunk's first forward until its last backward has run (FSDP's zero 2 keeps its
    parameters gathered over that span)."""
    accumulating: np.ndarray
    """1 from the chunk's first backward until its last one has run: its unsharded gradient exists
    (and under zero 3 with pp > 1 its gathered parameters, which stay until that last backward)."""


@functools.lru_cache(maxsize=64)
def interleaved_moments(pp: int, m: int, v: int) -> tuple[RankMoments, ...]:
    """Per pipeline rank of interleaved 1F1B, at each of its forwards and backwards (in the order the
    executor runs them: schedule/actions.py, which is also torch's Interleaved1F1B order when m is a
    multiple of p), what each chunk holds: micro-batches' activations (after a forward; before a
    backward frees them), and whether the chunk's FSDP parameters and unsharded gradient exist.

    Why the gradient's span matters ([Note: FSDP gathered bytes] in cost/memory.py): a stage's
    gradient is reduce-scattered, and its gathered parameters resharded, right after the stage's last
    backward (torch's pipelining: `perform_reduce_grad` after a stage's last B; autoplan's executor the
    same: the executor's `on_stage_backward_done`, runtime/execution/dimensions/dp.py). With m = p, every backward of chunk v - 1 runs
    before the first of chunk v - 2, so a rank never holds two chunks' gradients at once."""
    schedule = make_schedule("interleaved-1f1b", pp, m, v)
    out = []
    for actions in schedule.actions:
        compute = [a for a in actions if a.kind in (ActionKind.F, ActionKind.B)]
        chunk = np.array([a.stage // pp for a in compute])
        forward = np.array([a.kind is ActionKind.F for a in compute])
        mine = chunk[:, None] == np.arange(v)[None, :]  # (actions, chunks): the action's own chunk
        backward_here = mine & ~forward[:, None]
        forwards = np.cumsum(mine & forward[:, None], axis=0)  # forwards done, this one included
        backwards = np.cumsum(backward_here, axis=0) - backward_here  # backwards done before this action
        done = backwards >= m
        held = forwards - backwards  # after a forward; before a backward frees its micro-batch
        gathered = (forwards > 0) & ~done
        accumulating = ((backwards > 0) | backward_here) & ~done
        table = np.unique(np.concatenate([held, gathered, accumulating], axis=1).astype(np.int64), axis=0)
        out.append(RankMoments(table[:, :v], table[:, v:2 * v], table[:, 2 * v:]))
    return tuple(out)


def rank_moments(name: str, pp: int, m: int, v: int, rank: int, inflight: list[int]) -> RankMoments | None:
    """`interleaved_moments` of one rank of a looped schedule with v > 1, when their peaks agree with
    `inflight` (the per-chunk peaks the cutting used, `schedule_inflight`); else None, and the rank's
    memory is the sum of its chunks' peaks (an upper bound). `cost.memory.rank_memory` takes them."""
    if not schedule_spec(name).looped or v < 2:
        return None
    moments = interleaved_moments(pp, m, v)[rank]
    return moments if list(moments.held.max(axis=0)) == list(inflight) else None


@functools.lru_cache(maxsize=256)
def interleaved_at_peak(pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per virtual stage of interleaved 1F1B: what it holds at the moment its rank holds the most
    chunk-micro-batches (`interleaved_held`; ties: the most on the earliest chunk, which carries the
    embedding). The cutting DP checks stages one at a time with these; the plan's memory is then
    the exact peak over the moments (`rank_memories`)."""
    out = [0] * (pp * v)
    for r, rows in enumerate(interleaved_held(pp, m, v)):
        row = max(rows.tolist(), key=lambda h: (sum(h), h))
        for c in range(v):
            out[c * pp + r] = int(row[c])
    return tuple(out)


def _interleaved_inflight(pp: int, m: int, v: int) -> tuple[int, ...]:
    """Peak in flight per virtual stage of interleaved 1F1B, by a prefix scan of each rank's action
    order (a rank's own order fixes when its forwards and backwards happen relative to each other,
    so no timing is needed). The order is Megatron-LM's, as schedule/actions.py generates it:
    (p - r - 1) * 2 + (v - 1) * p warm-up forwards, then one forward and one backward at a time,
    micro-batches in groups of p through the chunks (backwards through them in reverse)."""
    total = m * v
    k = np.arange(total)
    fwd_chunk = (k % (pp * v)) // pp  # the k-th forward's chunk; the k-th backward's is v - 1 - it
    fwd_count = np.zeros((v, total + 1), dtype=np.int64)  # [c, i]: forwards of chunk c among the first i
    bwd_count = np.zeros((v, total + 1), dtype=np.int64)
    np.cumsum(fwd_chunk[None, :] == np.arange(v)[:, None], axis=1, out=fwd_count[:, 1:])
    np.cumsum((v - 1 - fwd_chunk)[None, :] == np.arange(v)[:, None], axis=1, out=bwd_count[:, 1:])
    peaks = [0] * (pp * v)
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        # Right after forward i (the only moments a chunk's count grows), the backwards done are
        # the first max(i - warmup, 0): in the steady phase forward warmup + j precedes backward j.
        held = fwd_count[fwd_chunk, k + 1] - bwd_count[fwd_chunk, np.maximum(k - warmup, 0)]
        peak = np.zeros(v, dtype=np.int64)
        np.maximum.at(peak, fwd_chunk, held)
        for c in range(v):
            peaks[c * pp + r] = int(peak[c])
    return tuple(peaks)
